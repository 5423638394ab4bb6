"""The generated model is the same everywhere: same spec, same bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvbroker.engine_ext.testmodel import ModelSpec, make_model

SMALL = ModelSpec(
    vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
)  # fmt: skip


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_spec_gives_identical_files_and_is_cached(tmp_path: Path) -> None:
    first = make_model(SMALL, tmp_path / "a")
    second = make_model(SMALL, tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(first / name) == digest(second / name), name
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert make_model(SMALL, tmp_path / "a") == first  # cached: not rebuilt
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["hidden_size"] == 64


def test_tokenizer_has_a_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_model(SMALL, tmp_path))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
