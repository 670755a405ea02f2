"""The `splitserve` command: one subcommand per module, imported only when that command runs.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`. Every long flag can also
come from the environment as `SPLITSERVE_<FLAG>` (dashes become underscores), which is how the
Kubernetes ConfigMap configures pods; a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("splitserve.serve", "start a local cluster: coordinator + prefill and decode workers"),
    "demo": ("splitserve.demo", "start a local cluster on the tiny model, send one chat request, stop"),
    "coordinator": ("coordinator.main", "run the gRPC coordinator alone (Kubernetes role)"),
    "prefill": ("prefill.main", "run one prefill worker alone (Kubernetes role)"),
    "decode": ("decode.main", "run one decode (or --mode colocated) worker alone (Kubernetes role)"),
    "generate": ("splitserve.client_cli", "stream a completion from a running server"),
    "chat": ("splitserve.client_cli", "stream a chat answer from a running server"),
    "bench": ("splitserve.bench", "serving benchmark: Poisson arrivals, TTFT/TPOT/ITL, SLO attainment"),
    "offline": ("engine.offline_cli", "generate with the in-process engine (no servers)"),
    "make-tiny-model": ("engine.tiny", "write a deterministic tiny Hugging Face checkpoint"),
    "keygen": ("splitserve.keygen", "write CurveZMQ keypairs for the control plane"),
    "fetch-model": (
        "engine.model_registry",
        "download and convert a registered real model once; print its path",
    ),
}


def _apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Make `SPLITSERVE_<FLAG>` the default of each `--flag` that the environment sets."""
    for action in parser._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if not long or action.dest == "help":
            continue
        env = "SPLITSERVE_" + long[0][2:].replace("-", "_").upper()
        if env in os.environ:
            raw = os.environ[env]
            if isinstance(action, argparse._StoreTrueAction):
                action.default = raw.strip().lower() in ("1", "true", "yes", "on")
            else:
                action.default = action.type(raw) if callable(action.type) else raw
            action.required = False


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported (all commands are listed either way)."""
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_module=module_name)
        if name == command:
            importlib.import_module(module_name).add_arguments(cmd)
            _apply_env_defaults(cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    return int(importlib.import_module(args._module).run(args))


if __name__ == "__main__":
    sys.exit(main())
