"""The shape of every READ this engine's connector issues: blocks, and runs of consecutive
block ids (``kvbroker.common.rules.fragmentation`` says why runs, not bytes, are what a READ
costs on a GPU).

vLLM's NIXL scheduler queues a READ in ``update_state_after_alloc``, once the destination
blocks are allocated: the handle's remote ids and the local blocks allocated for them
(``vllm_compat.pending_read``). Its worker pairs them as :func:`paired_ids` does, so the
scheduler side knows the READ's descriptors before the worker posts it, and the connector
counts them there (``engine_ext.connector_metrics``: ``kvbroker_read_blocks`` and
``kvbroker_read_runs``).

The READ's destination is the reader's freshly allocated blocks, which vLLM hands out in
descending ids after a free (``vllm_compat.sort_read_destination`` says why): the connector
first puts them in ascending order (:func:`coalesce_destination`), so that a source in runs
lands in runs.

Two kinds of READ go through the same path, told apart by the handle: a prefill engine reading
a conversation's retained KV from the decode engine that holds it (``d_to_p``: the handle
carries a kvbroker lease) and a decode engine pulling a prefill leg's KV from the prefill
engine (``p_to_d``: vLLM's own P/D handoff).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbroker.common.rules import handles
from kvbroker.common.rules.fragmentation import ReadShape, read_shape
from kvbroker.engine_ext.vllm_compat import (
    KVCacheManager,
    NixlPullConnectorScheduler,
    Request,
    pending_read,
    sort_read_destination,
)

D_TO_P = "d_to_p"
P_TO_D = "p_to_d"
DIRECTIONS = (D_TO_P, P_TO_D)


@dataclass(frozen=True, slots=True)
class IssuedRead:
    """A READ the connector queued: which kind, and its shape."""

    direction: str
    shape: ReadShape


def paired_ids(remote: Sequence[int], local: Sequence[int]) -> tuple[list[int], list[int]]:
    """(source, destination) ids as vLLM's NIXL worker pairs them
    (``NixlBaseWorker._apply_prefix_caching``): the local list holds only the blocks the
    local prefix cache lacks, so the remote list is trimmed from its start to the same length
    (the blocks the local cache has are the remote's first ones); a longer local list is cut
    to the remote's length."""
    count = min(len(remote), len(local))
    return list(remote[len(remote) - count :]), list(local[:count])


def direction_of(params: Mapping[str, Any]) -> str:
    """``d_to_p`` for a read of retained KV under a kvbroker lease, else ``p_to_d``."""
    return D_TO_P if params.get(handles.LEASE_ID_KEY) else P_TO_D


def coalesce_destination(
    manager: KVCacheManager | None, scheduler: NixlPullConnectorScheduler, request: Request
) -> bool:
    """Puts the destination blocks of the READ queued for ``request`` in ascending order (call
    it right after vLLM's ``update_state_after_alloc``); False where nothing was changed."""
    return manager is not None and sort_read_destination(manager, scheduler, request.request_id)


def issued_read(scheduler: NixlPullConnectorScheduler, request: Request) -> IssuedRead | None:
    """The READ vLLM's NIXL scheduler queued for ``request`` in this
    ``update_state_after_alloc`` (call it right after vLLM's), or None."""
    queued = pending_read(scheduler, request.request_id)
    if queued is None:
        return None
    source, destination = paired_ids(*queued)
    if not source:
        return None
    return IssuedRead(
        direction_of(request.kv_transfer_params or {}), read_shape(source, destination)
    )
