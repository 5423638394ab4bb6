"""The retained-tail rules (``engine_ext.retained_tail``) and the block copy that carries a
tail's KV into a new request (``vllm_compat.copy_kv_blocks``), on plain values and tensors."""

from __future__ import annotations

import pytest
import torch

from kvbroker.engine_ext.retained_tail import RetainedTail, TailPlan, tail_copies, tail_match
from kvbroker.engine_ext.vllm_compat import copy_kv_blocks, kv_block_dims

BLOCK = 4


def tail(tokens: list[int], kv_tokens: int, hashes: list[object]) -> RetainedTail:
    blocks = tuple(range(100, 100 + -(-len(tokens) // BLOCK)))
    return RetainedTail("retained", tokens, kv_tokens, blocks, hashes)


# A finished turn: 10 prompt tokens, then a 5-token answer whose last token has no KV.
TURN = list(range(1, 16))
HASHES: list[object] = ["h0", "h1", "h2"]  # its three full blocks


def test_the_tokens_past_the_hit_that_both_agree_on_are_matched() -> None:
    follow_up = [*TURN[:14], 90, 91, 92]
    # Hit: 8 tokens (2 blocks); the tail has KV for 14 tokens, all agreeing.
    assert tail_match(follow_up, HASHES, 8, tail(TURN, 14, HASHES), BLOCK) == 6


def test_the_match_stops_at_the_first_disagreement() -> None:
    follow_up = [*TURN[:11], 77, *TURN[12:], 90]
    assert tail_match(follow_up, HASHES, 8, tail(TURN, 14, HASHES), BLOCK) == 3


def test_the_last_prompt_token_is_always_left_to_compute() -> None:
    resend = TURN[:12]  # all of it has KV in the tail
    assert tail_match(resend, HASHES, 8, tail(TURN, 14, HASHES), BLOCK) == 3


def test_a_different_prefix_before_the_hit_matches_nothing() -> None:
    assert tail_match(TURN, ["h0", "other", "h2"], 8, tail(TURN, 14, HASHES), BLOCK) == 0


def test_a_hit_the_tail_has_no_hash_for_or_off_a_block_boundary_matches_nothing() -> None:
    short = tail(TURN, 14, HASHES[:1])
    assert tail_match(TURN, HASHES, 8, short, BLOCK) == 0
    assert tail_match(TURN, HASHES, 6, tail(TURN, 14, HASHES), BLOCK) == 0


def test_no_hit_at_all_matches_from_the_first_token() -> None:
    follow_up = [*TURN[:3], 50, 51]
    assert tail_match(follow_up, [], 0, tail(TURN, 14, HASHES), BLOCK) == 3


def test_copies_cover_the_blocks_of_the_matched_tokens_in_place() -> None:
    plan = TailPlan(tail(TURN, 14, HASHES), start=8, count=6)  # tokens 8..13: blocks 2, 3
    assert tail_copies(plan, [7, 8, 9, 10, 11], BLOCK) == [(102, 9), (103, 10)]
    assert tail_copies(TailPlan(plan.tail, 8, 0), [7, 8, 9], BLOCK) == []


@pytest.mark.parametrize("shape", [(6, 2, BLOCK, 3), (2, 6, BLOCK, 3)])
def test_blocks_are_copied_in_every_layer_along_the_block_dimension(
    shape: tuple[int, ...],
) -> None:
    caches = {name: torch.randn(shape) for name in ("layer.0", "layer.1")}
    before = {name: cache.clone() for name, cache in caches.items()}
    dims = kv_block_dims(caches, num_blocks=6)
    copy_kv_blocks(caches, dims, [(1, 4), (2, 5)])
    for name, cache in caches.items():
        dim = dims[name]
        assert torch.equal(cache.select(dim, 4), before[name].select(dim, 1))
        assert torch.equal(cache.select(dim, 5), before[name].select(dim, 2))
        for untouched in (0, 1, 2, 3):
            assert torch.equal(cache.select(dim, untouched), before[name].select(dim, untouched))


def test_a_layout_without_a_block_dimension_is_refused_at_registration() -> None:
    with pytest.raises(ValueError, match="kvbroker_retained_tail_reuse"):
        kv_block_dims({"layer.0": torch.zeros(3, 5, BLOCK)}, num_blocks=6)
