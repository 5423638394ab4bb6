"""The generated model is the same everywhere: same spec, same bytes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbroker_tools.testmodel import CHAT_TEMPLATE, CHAT_TEMPLATE_FILE, ModelSpec, make_model

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


def test_the_chat_template_renders_tools_calls_and_results_as_qwen3_does(tmp_path: Path) -> None:
    """What vLLM's hermes tool-call parser reads back: tools in the system turn, an
    assistant's calls as <tool_call> blocks, consecutive tool results one user turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_model(SMALL, tmp_path))
    tools: list[dict[Any, Any] | Callable[..., Any]] = [
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "b.txt"},
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert isinstance(text, str)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "ls"' in text
    assert text.count("<|im_start|>system") == 1
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>' in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n"
        "<tool_response>\nb.txt\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_a_model_built_before_the_template_changed_gets_todays(tmp_path: Path) -> None:
    built = make_model(SMALL, tmp_path)
    (built / CHAT_TEMPLATE_FILE).write_text("{{ 'old' }}")
    assert make_model(SMALL, tmp_path) == built
    assert (built / CHAT_TEMPLATE_FILE).read_text() == CHAT_TEMPLATE
