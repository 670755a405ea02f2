"""Incremental detokenization and stop strings: token ids in, text that is safe to stream out.

Shared by the offline `LLM` API (its `.text`) and the coordinator's output path (streamed deltas).

Decoding keeps a sliding window over the ids, as vLLM's `detokenize_incrementally` does:

    ids:  [ context: already emitted | not yet decoded ]
          0                     read_offset          len(ids)

    new text = decode(ids)[len(decode(ids[:read_offset])):]

The context tokens give the decoder the spacing it needs (a SentencePiece "▁" at the window start
is dropped by the decoder, the same in both decodes); bytes of a character cut by the window start
decode to the same "\ufffd" in both and cancel out. The window only advances (ids before
`read_offset` are dropped, the rest become the new context) when the new text does not end with
"\ufffd", so a byte-level token that ends inside a UTF-8 character is held until the character
completes. The window stays a few tokens long: each push costs O(new tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

# Prompt tokens kept as decoding context for the first output token (vLLM uses the same five).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class TextDelta:
    """What one `IncrementalDetokenizer.push` releases to the client.

    `text` is safe to show: it never ends inside a UTF-8 character and never shows part of a
    possible stop string. `token_ids` are the ids this push accepted: after a stop-string match,
    the ids up to and including the one that completed the match (later ids are discarded).
    """

    text: str
    token_ids: list[int]
    stopped: bool
    matched_stop: str | None


class IncrementalDetokenizer:
    """Turns one request's output token ids into streamable text and finds its stop strings.

    One per request, created and owned by whoever streams that request (the offline engine or the
    coordinator); not thread-safe. The text it releases, concatenated over all `push` calls and
    `finish`, equals `tokenizer.decode(prompt + output, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)` minus the decoded prompt; for a byte-level BPE tokenizer
    and a prompt that ends on a character boundary that is exactly `tokenizer.decode(output, ...)`.
    Tokenization-space clean-up is never applied: it is not stable under appending.

    Stop strings are checked after every token. When several are complete at that point, the one
    that starts earliest wins (the shorter on a tie). The request has ended once `push` reports
    `stopped` or `finish` was called; a further `push` is a caller bug and raises `RuntimeError`.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._stop_first_chars = frozenset(s[0] for s in self._stop)
        # Committed text that a stop string ending in later text could still overlap.
        self._tail_len = max((len(s) for s in self._stop), default=1) - 1

        self._ids = list(prompt_token_ids[max(0, len(prompt_token_ids) - _PROMPT_CONTEXT_TOKENS) :])
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

        self._emitted: list[str] = []
        self._held = ""  # committed, not emitted: a suffix that may begin a stop string
        self._tail = ""  # last `_tail_len` chars of committed text; `_held` is a suffix of it
        self._num_output_tokens = 0
        self._matched_stop: str | None = None
        self._finished = False

    @property
    def num_output_tokens(self) -> int:
        """Output ids accepted so far (ids after a stop-string match are not counted)."""
        return self._num_output_tokens

    @property
    def text(self) -> str:
        """All output text decoded so far: emitted plus held back (O(length): call it sparingly)."""
        return "".join(self._emitted) + self._held

    @property
    def matched_stop(self) -> str | None:
        return self._matched_stop

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `finish` ran; no more `push` calls are allowed."""
        return self._finished

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Appends new output ids and returns the text that is now safe to emit."""
        if self._finished:
            raise RuntimeError("push after the request ended (stop string matched or finish called)")
        pieces: list[str] = []
        accepted = len(token_ids)
        for i, token_id in enumerate(token_ids):
            self._ids.append(token_id)
            self._num_output_tokens += 1
            new_text = self._decode_next()
            if new_text:
                pieces.append(self._commit(new_text, final=False))
            if self._matched_stop is not None:
                accepted = i + 1
                self._finished = True
                break
        return TextDelta(
            text="".join(pieces),
            token_ids=list(token_ids[:accepted]),
            stopped=self._matched_stop is not None,
            matched_stop=self._matched_stop,
        )

    def finish(self) -> str:
        """Ends the request for a reason other than a stop string and returns the held-back text.

        Includes a trailing incomplete character as "\ufffd", as `tokenizer.decode` would. A stop
        string completed by that flushed text still truncates it (see `matched_stop`). Returns ""
        when the request already ended.
        """
        if self._finished:
            return ""
        self._finished = True
        full = self._decode(self._ids)
        return self._commit(full[len(self._prefix_text) :], final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_next(self) -> str:
        """New committed text from ids past `read_offset`, or "" while a character is incomplete
        (unless the complete text before it already holds a stop string: then that text, which
        ends the request)."""
        full = self._decode(self._ids)
        if len(full) <= len(self._prefix_text):
            return ""
        if full.endswith(_REPLACEMENT_CHAR):
            # Not committed: a later token may still change it. A stop string in it ends the
            # request here, as it would in the text decoded after this token.
            complete = full.rstrip(_REPLACEMENT_CHAR)[len(self._prefix_text) :]
            if not self._stop or self._find_stop(self._tail + complete, len(self._tail)) is None:
                return ""
            return complete
        new_text = full[len(self._prefix_text) :]
        # Advance the window and drop ids no later decode will look at.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text

    def _commit(self, new_text: str, *, final: bool) -> str:
        """Adds committed text; returns the part now safe to emit and records a stop-string match."""
        if not self._stop:
            self._emitted.append(new_text)
            return new_text
        buf = self._tail + new_text
        start = len(self._tail) - len(self._held)  # first char of `buf` not yet emitted
        match = self._find_stop(buf, len(self._tail))
        if match is not None:
            at, stop = match
            end = at + len(stop) if self._include_stop else at
            out, self._held, self._matched_stop = buf[start:end], "", stop
        else:
            keep = 0 if final or self._include_stop else self._stop_prefix_len(buf, start)
            out, self._held = buf[start : len(buf) - keep], buf[len(buf) - keep :]
        self._tail = buf[max(0, len(buf) - self._tail_len) :]
        self._emitted.append(out)
        return out

    def _find_stop(self, buf: str, new_from: int) -> tuple[int, str] | None:
        """Earliest stop string in `buf` that ends at or past `new_from` (the shorter on a tie)."""
        best: tuple[int, str] | None = None
        for s in self._stop:
            at = buf.find(s, max(0, new_from - len(s) + 1))
            if at >= 0 and (best is None or (at, len(s)) < (best[0], len(best[1]))):
                best = (at, s)
        return best

    def _stop_prefix_len(self, buf: str, start: int) -> int:
        """Length of the longest suffix of `buf[start:]` that is a proper prefix of a stop string."""
        for j in range(max(start, len(buf) - self._tail_len), len(buf)):
            if buf[j] in self._stop_first_chars and any(s.startswith(buf[j:]) for s in self._stop):
                return len(buf) - j
        return 0
