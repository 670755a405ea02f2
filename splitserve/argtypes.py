"""argparse `type`s shared by the CLIs (`serve`, `demo`, `bench`, `kvbench`): a bad value is a usage
error (exit 2) whose message names it, never a traceback. Checks that involve two flags belong to the
command, after parsing."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
Number = TypeVar("Number", int, float)


def checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse `type` from a parser raising ValueError: its message becomes the usage error."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _at_least(convert: Callable[[str], Number], kind: str, low: Number, what: str) -> Callable[[str], Number]:
    """`convert`ed text that is >= `low` (a NaN is not), else a usage error: '... is {what}'."""

    def parse(text: str) -> Number:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not value >= low:  # NaN too
            raise argparse.ArgumentTypeError(f"{text} is {what}")
        return value

    return parse


non_negative = _at_least(int, "an integer", 0, "negative (0: off)")
positive = _at_least(int, "an integer", 1, "not >= 1")
non_negative_float = _at_least(float, "a number", 0.0, "not >= 0 (0: off)")


def csv_of(
    convert: Callable[[str], T], what: str, check: Callable[[T], bool] = lambda _: True
) -> Callable[[str], list[T]]:
    """A comma-separated list of `convert`ed values passing `check`; a bad entry is a usage error
    naming it and `what` it should be, and so is an empty list."""

    def parse(text: str) -> list[T]:
        out = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            try:
                value: T | None = convert(part)
            except ValueError:
                value = None
            if value is None or not check(value):
                raise argparse.ArgumentTypeError(f"{part!r} is not {what}")
            out.append(value)
        if not out:
            raise argparse.ArgumentTypeError(f"want at least one {what}")
        return out

    return parse
