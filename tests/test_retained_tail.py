"""The retained-tail rules (``engine_ext.retained_tail``) and the block copy that carries a
tail's KV into a new request (``vllm_compat.copy_kv_blocks``), on plain values and tensors."""

from __future__ import annotations

import pytest
import torch
from vllm.utils import torch_utils

from kvbroker.engine_ext.retained_tail import RetainedTail, TailPlan, tail_copies, tail_match
from kvbroker.engine_ext.vllm_compat import copy_kv_blocks

BLOCK = 4
PLAIN = (0, None)  # no LoRA adapter, no cache salt


def tail(
    tokens: list[int], kv_tokens: int, hashes: list[object], identity: object = PLAIN
) -> RetainedTail:
    blocks = tuple(range(100, 100 + -(-len(tokens) // BLOCK)))
    return RetainedTail("retained", tokens, kv_tokens, blocks, hashes, identity)


# A finished turn: 10 prompt tokens, then a 5-token answer whose last token has no KV.
TURN = list(range(1, 16))
HASHES: list[object] = ["h0", "h1", "h2"]  # its three full blocks


def test_the_tokens_past_the_hit_that_both_agree_on_are_matched() -> None:
    follow_up = [*TURN[:14], 90, 91, 92]
    # Hit: 8 tokens (2 blocks); the tail has KV for 14 tokens, all agreeing.
    assert tail_match(follow_up, HASHES, PLAIN, 8, tail(TURN, 14, HASHES), BLOCK) == 6


def test_the_match_stops_at_the_first_disagreement() -> None:
    follow_up = [*TURN[:11], 77, *TURN[12:], 90]
    assert tail_match(follow_up, HASHES, PLAIN, 8, tail(TURN, 14, HASHES), BLOCK) == 3


def test_the_last_prompt_token_is_always_left_to_compute() -> None:
    resend = TURN[:12]  # all of it has KV in the tail
    assert tail_match(resend, HASHES, PLAIN, 8, tail(TURN, 14, HASHES), BLOCK) == 3


def test_a_different_prefix_before_the_hit_matches_nothing() -> None:
    assert tail_match(TURN, ["h0", "other", "h2"], PLAIN, 8, tail(TURN, 14, HASHES), BLOCK) == 0


def test_a_hit_the_tail_has_no_hash_for_or_off_a_block_boundary_matches_nothing() -> None:
    short = tail(TURN, 14, HASHES[:1])
    assert tail_match(TURN, HASHES, PLAIN, 8, short, BLOCK) == 0
    assert tail_match(TURN, HASHES, PLAIN, 6, tail(TURN, 14, HASHES), BLOCK) == 0


def test_no_hit_at_all_matches_from_the_first_token() -> None:
    follow_up = [*TURN[:3], 50, 51]
    assert tail_match(follow_up, [], PLAIN, 0, tail(TURN, 14, HASHES), BLOCK) == 3


def test_copies_cover_the_blocks_of_the_matched_tokens_in_place() -> None:
    plan = TailPlan(tail(TURN, 14, HASHES), start=8, count=6)  # tokens 8..13: blocks 2, 3
    assert tail_copies(plan, [7, 8, 9, 10, 11], BLOCK) == [(102, 9), (103, 10)]
    assert tail_copies(TailPlan(plan.tail, 8, 0), [7, 8, 9], BLOCK) == []


def test_another_adapter_or_salt_or_inputs_beyond_tokens_match_nothing() -> None:
    follow_up = [*TURN[:14], 90]
    salted = tail(TURN, 14, HASHES, identity=(0, "tenant-a"))
    assert tail_match(follow_up, HASHES, (0, "tenant-b"), 8, salted, BLOCK) == 0
    assert tail_match(follow_up, HASHES, (3, None), 8, tail(TURN, 14, HASHES), BLOCK) == 0
    # Prompt embeddings or images: the tokens do not say what the KV holds.
    assert tail_match(follow_up, HASHES, None, 8, tail(TURN, 14, HASHES), BLOCK) == 0
    assert tail_match(follow_up, HASHES, None, 8, tail(TURN, 14, HASHES, None), BLOCK) == 0
    assert tail_match(follow_up, HASHES, (0, "tenant-a"), 8, salted, BLOCK) == 6


@pytest.fixture
def unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM stages a block copy's indices in pinned host memory when its platform says it can
    pin (read once at import from 0.33 on, ``PIN_MEMORY``); a CUDA build on a machine without
    an NVIDIA driver says it can, then cannot. Without a GPU these caches are on the host,
    where the copy is what is tested and pinning buys nothing."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch_utils, "PIN_MEMORY", False, raising=False)


@pytest.mark.usefixtures("unpinned")
@pytest.mark.parametrize("kernel_blocks_per_block", [1, 2])
def test_blocks_are_copied_in_every_layer(kernel_blocks_per_block: int) -> None:
    """vLLM's CPU layout, [blocks, heads, tokens, channels], and one whose attention kernel
    splits each scheduler block in two."""
    num_blocks = 6
    shape = (num_blocks * kernel_blocks_per_block, 2, BLOCK // kernel_blocks_per_block, 3)
    caches = {name: torch.randn(shape) for name in ("layer.0", "layer.1")}
    before = {name: cache.clone() for name, cache in caches.items()}
    copy_kv_blocks(caches, num_blocks, [(1, 4), (2, 5)])
    for name, cache in caches.items():
        blocks = cache.unflatten(0, (num_blocks, kernel_blocks_per_block))
        old = before[name].unflatten(0, (num_blocks, kernel_blocks_per_block))
        assert torch.equal(blocks[4], old[1]) and torch.equal(blocks[5], old[2])
        assert torch.equal(blocks[:4], old[:4])
