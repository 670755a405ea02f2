"""engine.tiny: byte-deterministic checkpoints, a working tokenizer and chat template, decisive logits."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import tiny
from engine.loader import load_model, load_tokenizer
from engine.shapes import (
    BOS_ID,
    DEFAULT_SHAPE,
    IM_END_ID,
    IM_START_ID,
    SHAPES,
    SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
)

TEXTS = [
    "café ☕ 数字",
    "The hub is blinking red.\n\nTry  two spaces\tand a tab!",
    "Version 4.2.1 costs $19.99 😀",
]


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_inputs_give_the_same_bytes_across_processes(tmp_path: Path) -> None:
    code = "import sys; from engine.tiny import make_tiny_model; make_tiny_model(sys.argv[1], 'qwen3-2l', seed=3)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "a")], check=True)
    parser = argparse.ArgumentParser()
    tiny.add_arguments(parser)
    assert tiny.run(parser.parse_args([str(tmp_path / "b"), "--shape", "qwen3-2l", "--seed", "3"])) == 0
    a, b = files_of(tmp_path / "a"), files_of(tmp_path / "b")
    assert set(a) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert a == b

    tiny.make_tiny_model(tmp_path / "c", "qwen3-2l", seed=4)
    c = files_of(tmp_path / "c")
    assert c["model.safetensors"] != a["model.safetensors"]
    assert {k: v for k, v in c.items() if k != "model.safetensors"} == {
        k: v for k, v in a.items() if k != "model.safetensors"
    }


def test_unknown_shape_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown shape 'gpt-2l'"):
        tiny.make_tiny_model(tmp_path, "gpt-2l")
    parser = argparse.ArgumentParser()
    tiny.add_arguments(parser)
    assert parser.parse_args(["d"]).shape == DEFAULT_SHAPE
    with pytest.raises(SystemExit):
        parser.parse_args(["d", "--shape", "gpt-2l"])


def test_training_text_ships_with_the_package() -> None:
    files = list(resources.files("engine").joinpath("data").iterdir())
    sizes = [len(f.read_bytes()) for f in files if f.name.endswith(".txt")]
    assert len(sizes) == len(files) >= 1  # setuptools ships data/*.txt only
    assert 20_000 <= sum(sizes) <= 40_000


@pytest.mark.parametrize("shape", ["llama-2l", "qwen2-2l"])  # qwen2 loads as transformers' Qwen2Tokenizer
def test_tokenizer_round_trips_and_marks_special_tokens(
    shape: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    tokenizer = load_tokenizer(tiny_model_dir(shape))
    assert len(tokenizer) == TINY_VOCAB_SIZE == SHAPES[shape].vocab_size
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
        assert max(ids) < TINY_VOCAB_SIZE
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # merges were learned: ordinary English takes far fewer tokens than bytes
    sentence = "Unplug the hub for ten seconds and plug it back in."
    assert len(tokenizer(sentence).input_ids) < len(sentence) / 2.5


def test_chat_template_renders_chatml(tiny_model_dir: Callable[[str], Path]) -> None:
    loaded = load_model(tiny_model_dir(DEFAULT_SHAPE))
    assert loaded.chat_template == tiny.CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "café?"}]
    text = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ncafé?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = loaded.tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert ids.count(IM_START_ID) == 3 and ids.count(IM_END_ID) == 2
    assert IM_END_ID in loaded.config.eos_token_ids


@pytest.mark.parametrize("shape", ["llama-2l", "qwen2-2l", "qwen3-2l", "mistral-2l"])
def test_greedy_choice_is_decisive(shape: str, tiny_model_dir: Callable[[str], Path]) -> None:
    """The top-1/top-2 logit gap stays far above float32 noise, and the context changes the choice."""
    model_dir = tiny_model_dir(shape)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    text = (resources.files("engine") / "data" / "prose.txt").read_text(encoding="utf-8")
    ids = torch.tensor([tokenizer(text).input_ids[:512]])
    # 16 random histories that share their last token: a bigram-like model would predict one token for all
    histories = torch.randint(5, TINY_VOCAB_SIZE, (16, 32), generator=torch.Generator().manual_seed(0))
    histories[:, -1] = ids[0, -1]
    with torch.inference_mode():
        logits = model(ids).logits[0]
        last = model(histories).logits[:, -1]
    top2 = logits.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    assert gap.median() > 0.2
    assert (gap < 1e-3).float().mean() < 0.01
    assert len(set(last.argmax(-1).tolist())) >= 4
