"""A time bound that a running Jinja template cannot outlive: the watchdog of chat-template rendering.

Jinja compiles a template to Python code whose frames carry the file name `<template>`. While
`run_bounded(fn, deadline)` runs `fn` on the calling thread, a trace function (this thread only)
watches those frames and raises `RenderTimeout` inside the template at its next line once the deadline
has passed: the render unwinds, the thread is free for the next one, and nothing else is slowed (other
threads are not traced; non-template frames are not traced line by line). A template cannot catch it.

What it cannot stop: a single long C-level operation inside one template expression (such as a huge
string repetition) runs to its end before the next line event; `TokenizerThread` stops *waiting* at the
bound anyway, and the request's template has to be the operator's own or explicitly allowed
(--allow-request-chat-template) to get here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")
TEMPLATE_FILENAME = "<template>"  # what jinja2 `Environment.from_string` compiles to


class RenderTimeout(Exception):
    """The template was still running at its deadline."""


def run_bounded(fn: Callable[[], T], deadline: float) -> T:
    """`fn()` on this thread; RenderTimeout once `time.monotonic()` passes `deadline` in a template."""

    def in_template(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise RenderTimeout("the chat template ran past its time bound")
        return in_template

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return in_template if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    previous = sys.gettrace()  # a debugger's or coverage's tracer, restored afterwards
    sys.settrace(on_call)
    try:
        return fn()
    finally:
        sys.settrace(previous)
