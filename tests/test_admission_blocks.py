"""How many free blocks a decode engine needs to admit a request, read off vLLM's real block
pool: a prefix-cache hit on blocks that are themselves free (the previous turn's KV after
the prefill node read it) still takes those blocks out of the free pool, and only hits that
some request holds are shared for nothing. Undercounting this left long conversations'
follow-up turns waiting for blocks that no pressure release had been asked for."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvbroker.engine_ext.pressure import blocks_to_admit
from kvbroker.engine_ext.vllm_compat import free_blocks, local_hit_blocks_in_use

BLOCK_SIZE = 16


def make_request(request_id: str, tokens: int) -> Request:
    init_none_hash(sha256_cbor)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(tokens)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256_cbor),
    )


def test_hits_on_free_cached_blocks_cost_free_blocks_and_held_hits_do_not() -> None:
    pool = BlockPool(num_gpu_blocks=20, enable_caching=True, hash_block_size=BLOCK_SIZE)
    # The previous turn: 8 full blocks computed and cached.
    previous = make_request("turn-1", 8 * BLOCK_SIZE)
    blocks = pool.get_new_blocks(8)
    pool.cache_full_blocks(previous, blocks, 0, 8, BLOCK_SIZE, 0)
    follow_up = make_request("turn-2", 10 * BLOCK_SIZE)
    hit_blocks = 8

    # Held (retained for a read): the hits are shared, only the new tail needs blocks.
    assert local_hit_blocks_in_use(pool, follow_up, hit_blocks) == 8
    assert blocks_to_admit(follow_up.num_tokens, BLOCK_SIZE, 8) == 3
    assert free_blocks(pool) == 20 - 1 - 8  # vLLM keeps block 0 as its null block

    # Freed after the read: still cached (a local hit) but in the free pool, so admitting the
    # follow-up takes all of its blocks from the free count.
    pool.free_blocks(reversed(blocks))
    assert local_hit_blocks_in_use(pool, follow_up, hit_blocks) == 0
    assert blocks_to_admit(follow_up.num_tokens, BLOCK_SIZE, 0) == 11
    assert free_blocks(pool) == 19
