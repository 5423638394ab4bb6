"""The connector's part in retained-tail reuse (the rule and why it is safe:
``engine_ext.retained_tail``): on the scheduler side, the tail each conversation's last retained
turn leaves, the reuse planned for a request between the scheduler's question and its
allocation, and the step's block copies handed to the worker with the connector's metadata;
on the worker side, the copies made in the KV cache before the step's forward pass. Both
sides decide alike whether the engine can take a tail at all, from the same configuration.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbroker.engine_ext import vllm_compat
from kvbroker.engine_ext.retained_tail import (
    RetainedTail,
    RetainedTails,
    TailPlan,
    tail_copies,
    tail_match,
)
from kvbroker.engine_ext.vllm_compat import (
    KVCacheConfig,
    KVConnectorMetadata,
    Request,
    VllmConfig,
    block_copies,
    copy_kv_blocks,
    set_block_copies,
)

log = vllm_compat.engine_logger("tail_reuse")


class TailReuse:
    def __init__(
        self, wanted: bool, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        unsupported = vllm_compat.tail_reuse_unsupported(vllm_config, kv_cache_config)
        if wanted and unsupported:
            log.info("kvbroker: retained-tail copies are off: %s", unsupported)
        self.enabled = wanted and not unsupported
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks
        self._tails = RetainedTails()
        self._plans: dict[str, TailPlan] = {}
        self._copies: list[tuple[int, int]] = []
        # Worker side: the KV cache tensors the copies are made in.
        self._kv_caches: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------ scheduler side

    def match(
        self,
        request: Request,
        num_computed_tokens: int,
        session: str | None,
        copyable: Callable[[str], bool],
    ) -> int:
        """Tokens past the prefix-cache hit that the conversation's retained tail holds KV
        for, when ``copyable`` says its request may still be copied from: loaded by a block
        copy in this step, not recomputed."""
        self._plans.pop(request.request_id, None)
        tail = self._tails.get(session) if session else None
        if tail is None or not copyable(tail.request_id):
            return 0
        count = tail_match(
            request.all_token_ids,
            request.block_hashes,
            vllm_compat.token_identity(request),
            num_computed_tokens,
            tail,
            self._block_size,
        )
        if count > 0:
            self._plans[request.request_id] = TailPlan(tail, num_computed_tokens, count)
        return count

    def allocated(self, request_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        """The scheduler allocated the request's blocks for the tokens it took as external:
        the copies that fill them go with this step's metadata."""
        plan = self._plans.pop(request_id, None)
        if plan is not None and num_external_tokens > 0:
            plan = TailPlan(plan.tail, plan.start, num_external_tokens)
            self._copies += tail_copies(plan, block_ids, self._block_size)

    def finished(self, request_id: str) -> None:
        """The request finished before its allocation (aborted): its plan goes."""
        self._plans.pop(request_id, None)

    def keep(self, session: str, request: Request, kv_tokens: int, block_ids: list[int]) -> None:
        """The conversation's next DECODE_LOCAL turn may take this retained request's
        unfinished last block instead of recomputing it; a later turn's request replaces it."""
        if not self.enabled:
            return
        tail = RetainedTail(
            request_id=request.request_id,
            token_ids=request.all_token_ids,
            kv_tokens=min(kv_tokens, request.num_computed_tokens),
            block_ids=tuple(block_ids),
            block_hashes=request.block_hashes,
            identity=vllm_compat.token_identity(request),
        )
        self._tails.keep(session, tail)

    def freed(self, request_id: str) -> None:
        """The retained request's blocks were freed: its tail goes with them."""
        self._tails.forget(request_id)

    def hand_over(self, meta: KVConnectorMetadata) -> None:
        """This step's copies go to the worker with the step's metadata."""
        set_block_copies(meta, self._copies)
        self._copies = []

    # ------------------------------------------------------------ worker side

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.enabled:
            self._kv_caches = kv_caches

    def copy(self, meta: KVConnectorMetadata) -> None:
        """A step's copies land before its forward pass reads them."""
        pairs = block_copies(meta)
        if pairs:
            copy_kv_blocks(self._kv_caches, self._num_blocks, pairs)
