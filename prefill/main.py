"""`splitserve prefill`: one prefill worker (computes prompt KV and the first token, ships the KV)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.worker.settings import add_worker_arguments

    add_worker_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from engine.worker.process import run_worker
    from prefill.worker import PrefillWorker

    return run_worker(args, "prefill", PrefillWorker)
