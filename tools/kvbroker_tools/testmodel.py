"""A small local model for tests, the demo and the benchmark: a random-weight
Qwen3-architecture model and a byte-level BPE tokenizer trained here on generated text, with a
ChatML chat template that renders tools, tool calls and tool results in Qwen3's form (what
vLLM's ``hermes`` tool-call parser reads), so agents' requests with tools are served. Nothing
is downloaded; the same inputs give the same files everywhere
(fixed seeds, a deterministic corpus), and the result is cached by its parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

MODEL_NAME = "kvbroker-tiny-qwen3"

# Qwen3's template, simplified: without tools a conversation renders as plain ChatML; with
# tools the system turn lists them and says how to call one; an assistant's tool calls are
# <tool_call> blocks and consecutive tool results one user turn of <tool_response> blocks.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- set call = tool_call['function'] if tool_call['function'] else tool_call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + call['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}"
    "{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


@dataclass(frozen=True)
class ModelSpec:
    """Sized so that a CPU prefill of a few thousand tokens takes seconds while reading the
    same KV over NIXL takes tens of milliseconds."""

    vocab_size: int = 4096
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 16384
    dtype: str = "float32"
    seed: int = 0

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    root = os.environ.get("KVBROKER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvbroker"
    )
    return Path(root) / "models"


def corpus(lines: int = 20_000, seed: int = 1234) -> list[str]:
    """Deterministic pseudo-English: syllable words with a Zipf-like frequency."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai")]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    text = []
    for _ in range(lines):
        sentence = rng.choices(words, weights, k=rng.randint(4, 18))
        text.append(" ".join(sentence).capitalize() + rng.choice([".", "?", "!", ":"]))
    return text


def make_model(spec: ModelSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Builds the model once and returns its directory (cached by the spec's digest)."""
    spec = spec or ModelSpec()
    target = (cache_dir or default_cache_dir()) / f"{MODEL_NAME}-{spec.digest()}"
    if (target / "model.safetensors").exists():
        _refresh_chat_template(target)
        return target
    scratch = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    _write_tokenizer(scratch, spec)
    _write_weights(scratch, spec)
    try:
        scratch.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(scratch, ignore_errors=True)
    return target


# Where ``save_pretrained`` writes the tokenizer's chat template.
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _refresh_chat_template(directory: Path) -> None:
    """A model built before the template changed gets today's (it is not part of the spec's
    digest: the weights and vocabulary stay as built), written whole or not at all."""
    path = directory / CHAT_TEMPLATE_FILE
    if path.exists() and path.read_text() == CHAT_TEMPLATE:
        return
    scratch = path.with_name(f"{path.name}.tmp{os.getpid()}")
    scratch.write_text(CHAT_TEMPLATE)
    os.replace(scratch, path)


def _write_tokenizer(directory: Path, spec: ModelSpec) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def _write_weights(directory: Path, spec: ModelSpec) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=0,
        dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(eos_token_id=config.eos_token_id).save_pretrained(directory)


if __name__ == "__main__":
    print(make_model())
