"""The control-plane flags and names every role shares (import-light: `splitserve --help` reads them)."""

from __future__ import annotations

import argparse
import re

# Worker ids name sockets, metrics labels and log fields: printable ASCII, bounded.
WORKER_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def add_control_security_arguments(parser: argparse.ArgumentParser) -> None:
    """--control-key and --insecure-control-plane: the same on the coordinator and every worker."""
    parser.add_argument(
        "--control-key",
        default="",
        help="this process's CurveZMQ key file (NAME.key_secret from `splitserve keygen`)",
    )
    parser.add_argument(
        "--insecure-control-plane",
        action="store_true",
        help="plaintext, unauthenticated ZeroMQ control plane (testing only; logs a warning)",
    )
