"""The committed generated modules and docs section match the protos; staleness is detected and named."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from splitserve import protogen

REPO = protogen.REPO_ROOT
SERVING = f"{protogen.PROTO_DIR}/splitserve/v1/serving.proto"


def test_committed_generated_files_are_fresh() -> None:
    stale = protogen.stale_files(REPO)
    assert stale == [], f"stale generated files (run `make proto`): {stale}"


def test_generator_versions_are_recorded() -> None:
    assert protogen.recorded_versions(REPO) is not None


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """A copy of the protos and everything generated from them, to edit freely."""
    for rel in (protogen.PROTO_DIR, protogen.OUT_DIR):
        shutil.copytree(REPO / rel, tmp_path / rel, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / protogen.API_DOC, tmp_path / protogen.API_DOC)
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def _add_field(repo: Path) -> None:
    _edit(
        repo / SERVING, "repeated uint32 ids = 1;", "repeated uint32 ids = 1;\n  // New.\n  bool extra = 2;"
    )


def _set_recorded_versions(repo: Path, versions: dict[str, str]) -> None:
    init = repo / protogen.OUT_DIR / "__init__.py"
    init.write_text(re.sub(r"GENERATED_WITH = .*", f"GENERATED_WITH = {versions!r}", init.read_text()))


def test_added_field_names_every_stale_file(repo_copy: Path) -> None:
    _add_field(repo_copy)
    stale = protogen.stale_files(repo_copy)
    assert stale == sorted(
        [
            protogen.API_DOC,
            "splitserve/v1/serving_pb2.py",
            "splitserve/v1/serving_pb2.pyi",
            # control.proto imports serving.proto, but its own output does not change.
        ]
    )


def test_comment_change_makes_stubs_and_docs_stale(repo_copy: Path) -> None:
    _edit(repo_copy / SERVING, "Message text.", "The message text.")
    assert protogen.stale_files(repo_copy) == [protogen.API_DOC, "splitserve/v1/serving_pb2.pyi"]


def test_missing_and_leftover_modules_are_stale(repo_copy: Path) -> None:
    (repo_copy / "splitserve/v1/control_pb2.py").unlink()
    (repo_copy / "splitserve/v1/old_pb2.py").write_text("")
    assert protogen.stale_files(repo_copy) == ["splitserve/v1/control_pb2.py", "splitserve/v1/old_pb2.py"]


def test_other_generator_versions_compare_descriptors(repo_copy: Path) -> None:
    _set_recorded_versions(repo_copy, {"grpcio-tools": "0.0.1", "mypy-protobuf": "0.0.1"})
    # Bytes differ from what this toolchain writes (the recorded versions), yet nothing is stale ...
    assert protogen.stale_files(repo_copy) == []
    # ... until the schema changes.
    _add_field(repo_copy)
    assert protogen.stale_files(repo_copy) == [protogen.API_DOC, "splitserve/v1/serving_pb2.py"]


def test_write_regenerates_in_place(repo_copy: Path) -> None:
    _add_field(repo_copy)
    (repo_copy / "splitserve/v1/old_pb2.py").write_text("")
    changed = protogen.write(repo_copy)
    assert {"splitserve/v1/serving_pb2.py", "splitserve/v1/old_pb2.py"} <= set(changed)
    assert not (repo_copy / "splitserve/v1/old_pb2.py").exists()
    assert protogen.stale_files(repo_copy) == []
    assert "| `extra` | 2 | `bool` | New. |" in (repo_copy / protogen.API_DOC).read_text()


def test_splice_needs_both_markers() -> None:
    with pytest.raises(ValueError, match="markers"):
        protogen.splice_reference("# no markers\n", "ref")
    doc = f"a\n{protogen.DOC_BEGIN}\nold\n{protogen.DOC_END}\nb\n"
    assert (
        protogen.splice_reference(doc, "new") == f"a\n{protogen.DOC_BEGIN}\n\nnew\n\n{protogen.DOC_END}\nb\n"
    )
