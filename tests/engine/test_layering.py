"""The engine and the worker runtime never import the roles (prefill/, decode/) or the coordinator:
the roles hand their class to the runtime (prefill/main.py, decode/main.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import engine

UP = ("prefill", "decode", "coordinator")


def test_engine_imports_nothing_above_it() -> None:
    root = Path(engine.__file__).parent
    upward = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            upward += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in UP]
    assert not upward
