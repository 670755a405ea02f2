"""`splitserve keygen`: CurveZMQ keypairs for the control plane (see deploy/README.md).

`splitserve keygen --out DIR coordinator prefill decode` writes `NAME.key` (public) and
`NAME.key_secret` (0600) per name. A worker key's name must start with the role it may register
as (`prefill`, `decode`, `colocated`): the coordinator reads the role from the public key's file name
in its `--control-authorized-keys` dir.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="directory to write the key files into")
    parser.add_argument(
        "names", nargs="+", help="one keypair per name: coordinator, or a name starting with a worker role"
    )


def run(args: argparse.Namespace) -> int:
    from splitserve.control_auth import ControlKeyError, create_keypair, role_of_key_file

    for name in args.names:
        if name != "coordinator":
            try:
                role_of_key_file(name)
            except ControlKeyError as exc:
                print(f"splitserve keygen: {exc}", file=sys.stderr)
                return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        if (args.out / f"{name}.key_secret").exists():
            print(f"splitserve keygen: {args.out / name}.key_secret exists; not overwritten", file=sys.stderr)
            return 2
    for name in args.names:
        public, secret = create_keypair(args.out, name)
        print(f"wrote {public} and {secret}")
    return 0
