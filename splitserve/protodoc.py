"""Renders the field-by-field API reference (Markdown) from proto descriptors and their comments.

Used by `splitserve.protogen` to fill the generated section of docs/api.md, so the comments in the
`.proto` files are the one source of every field's documentation. Definitions appear in source order;
type names link to their own section.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

from google.protobuf import descriptor_pb2

FDP = descriptor_pb2.FieldDescriptorProto
_SCALAR_NAMES = {number: name.removeprefix("TYPE_").lower() for name, number in FDP.Type.items()}
# Field numbers of the descriptor messages, as SourceCodeInfo paths use them.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE, _FILE_SYNTAX = 4, 5, 6, 12
_MSG_FIELD, _MSG_NESTED, _MSG_ENUM = 2, 3, 4
_ENUM_VALUE = 2
_SERVICE_METHOD = 2
_HTML_START = re.compile(r"<(?=[A-Za-z/!])")

Path_ = tuple[int, ...]


class _Comments:
    """Leading comments and start lines of one file's definitions, by SourceCodeInfo path."""

    def __init__(self, file: descriptor_pb2.FileDescriptorProto) -> None:
        self._text: dict[Path_, str] = {}
        self._line: dict[Path_, int] = {}
        for loc in file.source_code_info.location:
            path = tuple(loc.path)
            self._text[path] = loc.leading_comments
            self._line[path] = loc.span[0]

    def text(self, path: Path_) -> str:
        """The comment as paragraphs: lines joined with spaces, blank lines kept as breaks."""
        paragraphs = self._text.get(path, "").strip().split("\n\n")
        return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)

    def line(self, path: Path_) -> int:
        return self._line.get(path, 0)


def _anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def _cell(text: str) -> str:
    text = _HTML_START.sub("&lt;", text.replace("\n\n", " ").replace("|", "\\|").replace("*", "\\*"))
    return text or "—"


class _Renderer:
    def __init__(self, files: Sequence[descriptor_pb2.FileDescriptorProto]) -> None:
        self.root = _common_package([f.package for f in files])
        self.headings: dict[str, str] = {}  # full type name -> heading text
        for file in files:
            for full_name in _type_names(file.package, file.message_type, file.enum_type):
                self.headings[full_name] = self._short(full_name)

    def _short(self, full_name: str) -> str:
        return ".".join(full_name.split(".")[len(self.root) :])

    def type_ref(self, type_name: str) -> str:
        full = type_name.lstrip(".")
        heading = self.headings.get(full)
        return f"[`{heading}`](#{_anchor(heading)})" if heading else f"`{full}`"

    def field_type(self, msg: descriptor_pb2.DescriptorProto, field: FDP) -> str:
        if field.type in (FDP.TYPE_MESSAGE, FDP.TYPE_ENUM):
            base = self.type_ref(field.type_name)
        else:
            base = f"`{_SCALAR_NAMES[field.type]}`"
        if field.label == FDP.LABEL_REPEATED:
            return f"repeated {base}"
        if field.proto3_optional:
            return f"optional {base}"
        if field.HasField("oneof_index"):
            return f"{base} (oneof `{msg.oneof_decl[field.oneof_index].name}`)"
        return base

    def file(self, file: descriptor_pb2.FileDescriptorProto) -> list[str]:
        comments = _Comments(file)
        out = [
            f"### {os.path.basename(file.name)} (package `{file.package}`)",
            "",
            comments.text((_FILE_SYNTAX,)),
        ]
        blocks: list[tuple[int, list[str]]] = []
        for i, service in enumerate(file.service):
            path = (_FILE_SERVICE, i)
            blocks.append((comments.line(path), self.service(file.package, service, comments, path)))
        for i, msg in enumerate(file.message_type):
            path = (_FILE_MESSAGE, i)
            blocks.append((comments.line(path), self.message(file.package, msg, comments, path)))
        for i, enum in enumerate(file.enum_type):
            path = (_FILE_ENUM, i)
            blocks.append((comments.line(path), self.enum(file.package, enum, comments, path)))
        for _, block in sorted(blocks, key=lambda b: b[0]):
            out += ["", *block]
        return out

    def service(
        self, package: str, service: descriptor_pb2.ServiceDescriptorProto, comments: _Comments, path: Path_
    ) -> list[str]:
        rows = ["| method | request | response | description |", "|---|---|---|---|"]
        for j, m in enumerate(service.method):
            response = ("stream " if m.server_streaming else "") + self.type_ref(m.output_type)
            request = ("stream " if m.client_streaming else "") + self.type_ref(m.input_type)
            doc = _cell(comments.text((*path, _SERVICE_METHOD, j)))
            rows.append(f"| `{m.name}` | {request} | {response} | {doc} |")
        heading = f"service {self._short(f'{package}.{service.name}')}"
        return [f"#### {heading}", "", comments.text(path), "", *rows]

    def message(
        self, scope: str, msg: descriptor_pb2.DescriptorProto, comments: _Comments, path: Path_
    ) -> list[str]:
        full = f"{scope}.{msg.name}"
        out = [f"#### {self.headings[full]}", "", comments.text(path), ""]
        if msg.field:
            out += ["| field | # | type | description |", "|---|---|---|---|"]
            for j, f in enumerate(msg.field):
                doc = _cell(comments.text((*path, _MSG_FIELD, j)))
                out.append(f"| `{f.name}` | {f.number} | {self.field_type(msg, f)} | {doc} |")
        else:
            out.append("No fields.")
        for j, nested in enumerate(msg.nested_type):
            out += ["", *self.message(full, nested, comments, (*path, _MSG_NESTED, j))]
        for j, enum in enumerate(msg.enum_type):
            out += ["", *self.enum(full, enum, comments, (*path, _MSG_ENUM, j))]
        return out

    def enum(
        self, scope: str, enum: descriptor_pb2.EnumDescriptorProto, comments: _Comments, path: Path_
    ) -> list[str]:
        rows = ["| value | # | description |", "|---|---|---|"]
        for j, v in enumerate(enum.value):
            rows.append(f"| `{v.name}` | {v.number} | {_cell(comments.text((*path, _ENUM_VALUE, j)))} |")
        return [f"#### {self.headings[f'{scope}.{enum.name}']}", "", comments.text(path), "", *rows]


def _common_package(packages: Sequence[str]) -> list[str]:
    """The leading package segments all `packages` share, e.g. ["splitserve", "v1"]."""
    root: list[str] = []
    for segments in zip(*(p.split(".") for p in packages), strict=False):
        if len(set(segments)) > 1:
            break
        root.append(segments[0])
    return root


def _type_names(
    scope: str,
    messages: Iterable[descriptor_pb2.DescriptorProto],
    enums: Iterable[descriptor_pb2.EnumDescriptorProto],
) -> list[str]:
    names = [f"{scope}.{e.name}" for e in enums]
    for msg in messages:
        full = f"{scope}.{msg.name}"
        names += [full, *_type_names(full, msg.nested_type, msg.enum_type)]
    return names


def render_reference(descriptors: descriptor_pb2.FileDescriptorSet, names: Sequence[str]) -> str:
    """Markdown for the files `names` of `descriptors` (compiled with --include_source_info)."""
    by_name = {f.name: f for f in descriptors.file}
    files = [by_name[name] for name in names]
    renderer = _Renderer(files)
    lines: list[str] = []
    for file in files:
        lines += [*renderer.file(file), ""]
    return "\n".join(lines).strip() + "\n"
