"""`splitserve decode [--mode colocated]`: one decode worker, or a colocated prefill+decode worker."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.worker.settings import add_worker_arguments

    add_worker_arguments(parser, with_mode=True)


def run(args: argparse.Namespace) -> int:
    from decode.worker import DecodeWorker
    from engine.worker.process import run_worker

    return run_worker(args, "colocated" if args.mode == "colocated" else "decode", DecodeWorker)
