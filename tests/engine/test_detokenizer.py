"""IncrementalDetokenizer: streamed text equals a full decode, UTF-8 is never split, stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine.detokenizer import IncrementalDetokenizer, TextDelta
from engine.tiny import tokenizer_json

EOS = "<|endoftext|>"
CORPUS = [
    "hello world, hello café ☕ and hello again",
    "数字 means digits; 数字 数字 hello",
    "emoji time 😀 🚀 café ☕ — naïve résumé",
    "the quick brown fox jumps over the lazy dog",
] * 4
ALPHABET = "abc STOP\né☕数字😀"


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS, "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def metaspace_tok() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: its decoder drops the "▁" space of the first token."""
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tiny_tok() -> PreTrainedTokenizerFast:
    """The byte-level BPE that `splitserve make-tiny-model` ships (the offline API's tokenizer)."""
    raw = Tokenizer.from_str(tokenizer_json())
    return PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False)


def token_id(tok: PreTrainedTokenizerFast, token: str) -> int:
    tid = tok.convert_tokens_to_ids(token)
    assert isinstance(tid, int) and tid != tok.unk_token_id, token
    return tid


def byte_ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One token per UTF-8 byte, so multi-byte characters always span several tokens."""
    table = bytes_to_unicode()
    return [token_id(tok, table[b]) for b in text.encode()]


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = (1,)
) -> list[TextDelta]:
    """Pushes `ids` in chunks (sizes cycled) until they run out or a stop string matches."""
    deltas: list[TextDelta] = []
    pos, k = 0, 0
    while pos < len(ids) and not detok.finished:
        size = max(1, chunk_sizes[k % len(chunk_sizes)])
        deltas.append(detok.push(ids[pos : pos + size]))
        pos, k = pos + size, k + 1
    return deltas


def joined(deltas: Sequence[TextDelta]) -> str:
    return "".join(d.text for d in deltas)


def full_decode(tok: PreTrainedTokenizerFast, ids: Sequence[int], skip: bool) -> str:
    text = tok.decode(list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    return text


def assert_streams_full_decode(
    tok: PreTrainedTokenizerFast, prompt: list[int], ids: list[int], skip: bool, chunk_sizes: list[int]
) -> None:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    expected = full_decode(tok, ids, skip)
    deltas = stream(detok, ids, chunk_sizes)
    for i in range(len(deltas)):
        # Emitted text is final: it never changes once shown.
        assert expected.startswith(joined(deltas[: i + 1]))
    assert joined(deltas) + detok.finish() == expected
    assert [t for d in deltas for t in d.token_ids] == ids
    assert detok.num_output_tokens == len(ids)
    assert not any(d.stopped for d in deltas)
    if "\ufffd" not in expected:
        assert not any("\ufffd" in d.text for d in deltas)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    skip=st.booleans(),
    with_prompt=st.booleans(),
    chunk_sizes=st.lists(st.integers(1, 7), min_size=1, max_size=4),
)
def test_deltas_concatenate_to_full_decode(
    tok: PreTrainedTokenizerFast, data: Any, skip: bool, with_prompt: bool, chunk_sizes: list[int]
) -> None:
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=40))
    prompt = tok.encode("prompt: café ☕ 数字") if with_prompt else []
    assert_streams_full_decode(tok, prompt, ids, skip, chunk_sizes)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), skip=st.booleans(), chunk=st.integers(1, 7))
def test_repo_tiny_tokenizer_streams_full_decode(
    tiny_tok: PreTrainedTokenizerFast, data: Any, skip: bool, chunk: int
) -> None:
    ids = data.draw(st.lists(st.integers(0, len(tiny_tok) - 1), max_size=40))
    assert_streams_full_decode(tiny_tok, tiny_tok.encode("Why is my device blinking?"), ids, skip, [chunk])


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=30), per_byte=st.booleans())
def test_valid_text_never_shows_a_partial_character(
    tok: PreTrainedTokenizerFast, text: str, per_byte: bool
) -> None:
    ids = byte_ids(tok, text) if per_byte else tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("hi"))
    deltas = stream(detok, ids)
    assert not any("\ufffd" in d.text for d in deltas)
    assert joined(deltas) == text  # every character completes with its last byte: nothing left held
    assert detok.finish() == ""
    assert detok.text == text


def test_prompt_context_keeps_the_leading_space(metaspace_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(metaspace_tok, metaspace_tok.encode("the quick"))
    assert detok.push(metaspace_tok.encode("brown fox")).text == " brown fox"
    no_context = IncrementalDetokenizer(metaspace_tok, [])
    assert no_context.push(metaspace_tok.encode("brown fox")).text == "brown fox"


@settings(max_examples=200, deadline=None)
@given(data=st.data(), skip=st.booleans(), chunk=st.integers(1, 5))
def test_text_is_decode_of_prompt_and_output_minus_prompt(
    metaspace_tok: PreTrainedTokenizerFast, data: Any, skip: bool, chunk: int
) -> None:
    vocab = len(metaspace_tok)
    prompt = data.draw(st.lists(st.integers(2, vocab - 1), max_size=12))  # no special tokens
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=30))
    detok = IncrementalDetokenizer(metaspace_tok, prompt, skip_special_tokens=skip)
    prompt_text = full_decode(metaspace_tok, prompt, skip)
    expected = full_decode(metaspace_tok, prompt + ids, skip)
    assert expected.startswith(prompt_text)
    assert joined(stream(detok, ids, [chunk])) + detok.finish() == expected[len(prompt_text) :]


def test_partial_character_is_held_until_it_completes(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [])
    first, second, third = byte_ids(tok, "☕")
    assert [detok.push([first]).text, detok.push([second]).text, detok.push([third]).text] == ["", "", "☕"]


def test_incomplete_character_is_flushed_by_finish(tok: PreTrainedTokenizerFast) -> None:
    ids = byte_ids(tok, "ok ☕")[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert joined(stream(detok, ids)) == "ok "
    assert detok.finish() == "\ufffd" == full_decode(tok, ids, True)[-1]
    with pytest.raises(RuntimeError):
        detok.push(byte_ids(tok, "x"))


def test_special_tokens_skipped_or_kept(tok: PreTrainedTokenizerFast) -> None:
    ids = [
        *byte_ids(tok, "a"),
        tok.eos_token_id,
        token_id(tok, "<|im_start|>"),
        *byte_ids(tok, "b"),
    ]
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert joined(stream(skipped, ids)) + skipped.finish() == "ab"
    assert joined(stream(kept, ids)) + kept.finish() == f"a{EOS}<|im_start|>b"


def _stop_case(tok: PreTrainedTokenizerFast, span: int) -> tuple[list[int], str, str]:
    """(ids, stop, text before it) with a stop string spanning `span` tokens."""
    if span == 1:
        hello = token_id(tok, "hello")
        assert full_decode(tok, [hello], True) == "hello"
        # "ell" sits inside one token; the "o" after it, in the same token, must never be shown.
        return [*byte_ids(tok, "say "), hello, *byte_ids(tok, " more")], "ell", "say h"
    stop = {2: "ST", 3: "STO", 5: "é☕"}[span]
    assert len(byte_ids(tok, stop)) == span
    return byte_ids(tok, f"go {stop} after {stop}"), stop, "go "


@pytest.mark.parametrize("span", [1, 2, 3, 5])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_stop_string_spanning_tokens(tok: PreTrainedTokenizerFast, span: int, chunk: int) -> None:
    ids, stop, before = _stop_case(tok, span)
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    deltas = stream(detok, ids, [chunk])
    assert joined(deltas) == before
    assert [d.stopped for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].matched_stop == stop == detok.matched_stop
    accepted = [t for d in deltas for t in d.token_ids]
    # Ids are accepted up to and including the one that completed the stop string.
    assert full_decode(tok, accepted, True).startswith(before + stop)
    assert not full_decode(tok, accepted[:-1], True).startswith(before + stop)
    assert detok.num_output_tokens == len(accepted)
    assert detok.finished and detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.push(ids[:1])


def test_include_stop_str_in_output(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=True)
    deltas = stream(detok, byte_ids(tok, "a STOP b"))
    assert joined(deltas) == "a STOP"
    assert detok.matched_stop == "STOP"


def test_possible_stop_prefix_is_held_then_released(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert [d.text for d in stream(detok, byte_ids(tok, "ab ST"))] == ["a", "b", " ", "", ""]
    assert detok.text == "ab ST"
    assert detok.finish() == "ST"

    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas = stream(detok, byte_ids(tok, "ST!"))
    assert [d.text for d in deltas] == ["", "", "ST!"]  # released once it can no longer be a stop
    assert detok.finish() == ""


def test_earliest_stop_wins(tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["STOP", "b S", "cab"])
    deltas = stream(detok, byte_ids(tok, "a cab STOP"), [100])
    assert (joined(deltas), detok.matched_stop) == ("a ", "cab")

    # Both complete within the same token: the one that starts first wins, the shorter on a tie.
    hello = [token_id(tok, "hello")]
    for stops, before, matched in [(["llo", "ell"], "h", "ell"), (["hel", "he", "o"], "", "he")]:
        detok = IncrementalDetokenizer(tok, [], stop=stops)
        assert (detok.push(hello).text, detok.matched_stop) == (before, matched)


def _reference_stop(text_after: list[str], stops: list[str]) -> tuple[str, str | None]:
    """Text before the first stop found, checking the decoded text after every token."""
    for text in text_after:
        found = [(text.find(s), len(s), s) for s in stops if s in text]
        if found:
            at, _, stop = min(found)
            return text[:at], stop
    return text_after[-1] if text_after else "", None


@settings(max_examples=300, deadline=None)
# the space is whole one token before the emoji completes: its stop string wins there
@example(text="O 😀", stops=[" ", "O 😀"], chunk_sizes=[1], per_byte=False)
@given(
    text=st.text(alphabet=ALPHABET, max_size=30),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    chunk_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    per_byte=st.booleans(),
)
def test_stop_strings_match_reference(
    tok: PreTrainedTokenizerFast, text: str, stops: list[str], chunk_sizes: list[int], per_byte: bool
) -> None:
    ids = byte_ids(tok, text) if per_byte else tok.encode(text)
    expected, expected_stop = _reference_stop(
        [full_decode(tok, ids[: i + 1], True) for i in range(len(ids))], stops
    )
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    deltas = stream(detok, ids, chunk_sizes)
    for d in deltas:
        assert "\ufffd" not in d.text
    assert joined(deltas) + detok.finish() == expected
    assert detok.matched_stop == expected_stop


def test_empty_stop_string_rejected(tok: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=["ok", ""])


class _RecordingBackend:
    """Forwards to the real Rust tokenizer and records how many ids each decode saw."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


class _RecordingTokenizer(PreTrainedTokenizerFast):
    recorder: _RecordingBackend

    @property
    def backend_tokenizer(self) -> Any:
        return self.recorder


def test_decode_window_stays_small(tok: PreTrainedTokenizerFast) -> None:
    recording = _RecordingTokenizer(tokenizer_object=tok.backend_tokenizer)
    recording.recorder = _RecordingBackend(tok.backend_tokenizer)
    text = "hello café ☕ 数字 😀 " * 100
    ids = byte_ids(tok, text)
    detok = IncrementalDetokenizer(recording, tok.encode("a long prompt " * 50), stop=["never"])
    assert joined(stream(detok, ids)) + detok.finish() == text
    # Prompt context plus the bytes of one held character, never the whole output.
    assert max(recording.recorder.window_sizes) <= 10
    assert len(recording.recorder.window_sizes) <= 2 * len(ids) + 2
