"""kvbroker's KV connector: vLLM's NIXL pull connector, with retention under leases and a
verified local-then-remote match.

Load it into unmodified vLLM with::

    --kv-transfer-config '{"kv_connector": "NixlConnector",
                           "kv_connector_module_path": "kvbroker.engine_ext.connector", ...}'

It keeps vLLM's class name because several of vLLM's config checks match on it.

Decode side: a finished request with bidirectional transfer keeps its blocks as vLLM does, and
the handle (with kvbroker's prefix hashes and the conversation id) goes to the sidecar. From
then on the deadline comes from the lease: its idle TTL, extended by turns and renewals,
shortened by revocations, ended by expiry; ``decoder_kv_blocks_ttl`` caps every deadline so
blocks are freed even if the control plane disappears. Retained KV is a cache: when the
scheduler cannot admit or grow a request for lack of free blocks, or retention holds more than
its budget, the lowest-value conversations are reclaimed through the registry at once
(``engine_ext.pressure``). Requests without a conversation id are not retained. Frees are
reported back with their cause. An engine core asked to stop frees everything it retains at
once, so that it can exit (``_depart``).

Prefill side: a remote handle is used only when its lease is live at its epoch (asked through
the sidecar), only up to the first block whose hash differs from this prompt's, and only when
the reusable remainder meets ``kv_recompute_threshold``; otherwise the handle is removed and P
recomputes (the rule: ``engine_ext.verdict``). A long prompt with no handle of its own may be
given one by content first (a fork of another conversation: ``engine_ext.prefix_match``), read
without freeing the decode node's blocks. vLLM's own prefix cache is consulted first
(``num_computed_tokens``). The lease check runs on the sidecar link's thread: until it answers,
the request is reported as "not known yet" and vLLM's scheduler asks again next step
(``engine_ext.lease_check``).

Its ``kv_connector_extra_config`` keys are ``engine_ext.settings``; what it tells its sidecar
about the engine, ``engine_ext.engine_info``. vLLM and NIXL are reached only through
``engine_ext.vllm_compat``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvbroker.common.client.engine_link import EngineLink
from kvbroker.common.rules import handles
from kvbroker.common.rules.checkpoints import Checkpoints
from kvbroker.common.rules.retention_deadline import (
    LeaseDeadline,
    RetentionDeadline,
    first_deadline,
    next_deadline,
)
from kvbroker.engine_ext import vllm_compat
from kvbroker.engine_ext.connector_metrics import (
    ConnectorMetricsClasses,
    MetricsRecorder,
    retention_gauges,
    worker_stats,
)
from kvbroker.engine_ext.engine_info import engine_info
from kvbroker.engine_ext.fragmentation import coalesce_destination, issued_read
from kvbroker.engine_ext.idle import IdlePause
from kvbroker.engine_ext.lease_check import PendingCheck, settle_remote
from kvbroker.engine_ext.prefix import prefix_hashes
from kvbroker.engine_ext.prefix_match import PendingMatch, end_pin, settle_match
from kvbroker.engine_ext.pressure import (
    RetainedRequest,
    admission_shortfall,
    blocks_to_admit,
    choose_reclaims,
    end_cause_of_free,
)
from kvbroker.engine_ext.settings import KvBrokerSettings
from kvbroker.engine_ext.tail_reuse import TailReuse
from kvbroker.engine_ext.vllm_compat import (
    BlockPool,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheManager,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    Request,
    SchedulerOutput,
    VllmConfig,
    free_blocks,
    local_hit_blocks_in_use,
)
from kvbroker.v1 import lease_pb2, registry_pb2

log = vllm_compat.engine_logger("connector")


class NixlConnector(ConnectorMetricsClasses, NixlPullConnector):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        self.settings = KvBrokerSettings.from_extra_config(
            vllm_compat.kv_connector_extra_config(vllm_config)
        )
        if role == KVConnectorRole.WORKER:
            vllm_compat.calm_progress_thread(self.settings.progress_thread_delay_us)
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        # Requests vLLM tracks for retention (went through update_state_after_alloc with
        # transfer params); others must not be retained (vLLM 0.32 would leak their blocks).
        self._tracked: set[str] = set()
        # Prefill side: lease checks and prefix matches still in flight, by request id.
        self._pending_checks: dict[str, PendingCheck] = {}
        self._pending_matches: dict[str, PendingMatch] = {}
        # Decode side: what is retained, by request id.
        self._retained: dict[str, RetainedRequest] = {}
        self._budget_blocks = int(self.settings.retention_max_fraction * kv_cache_config.num_blocks)
        # Blocks the scheduler lacked this step to admit a waiting request (0: none).
        self._shortfall_blocks = 0
        # Waiting requests the scheduler asked about and has not admitted, since when; and
        # whether its last step scheduled nothing (an idle engine frees no blocks by itself).
        self._unadmitted: dict[str, float] = {}
        self._starved: set[str] = set()  # those already logged as short of blocks
        self._scheduled_nothing = False
        self._idle = IdlePause(self.settings.idle_wait_s, self.settings.idle_step_sleep_s)
        self._block_pool: BlockPool | None = None
        # Decode side: since the engine core was asked to stop, nothing is retained.
        self._departing = False
        self._tail = TailReuse(self.settings.retained_tail_reuse, vllm_config, kv_cache_config)
        self._retains = vllm_compat.retains_kv(vllm_config)
        # What /metrics shows of this engine (engine_ext.connector_metrics).
        self._metrics = MetricsRecorder()
        self.link: EngineLink | None = None
        if role == KVConnectorRole.SCHEDULER and self.settings.sidecar:
            self.link = EngineLink(
                self.settings.sidecar,
                engine_info(
                    vllm_config, kv_cache_config, self._budget_blocks, self.settings.hard_cap_s
                ),
            )
            self.link.start()
            log.info("kvbroker link to the sidecar at %s started", self.settings.sidecar)

    @property
    def _sched(self) -> NixlPullConnectorScheduler:
        assert isinstance(self.connector_scheduler, NixlPullConnectorScheduler)
        return self.connector_scheduler

    # ------------------------------------------------------------ prefill side

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """vLLM 0.32 hands the scheduler's cache manager to its connector after building it:
        the one documented way for a connector to see how many blocks are free."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._block_pool = kv_cache_manager.block_pool
        self._kv_cache_manager = kv_cache_manager  # engine_ext.fragmentation

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        matched = self._match(request, num_computed_tokens)
        if self._retained and matched[0] is not None:
            self._note_demand(request, num_computed_tokens)
        return matched

    def _note_demand(self, request: Request, num_computed_tokens: int) -> None:
        """The scheduler asks this for each waiting request it is about to admit: if the free
        blocks cannot hold its prompt, retention owes the difference."""
        pool = self._block_pool
        if pool is None:
            return
        in_use = local_hit_blocks_in_use(pool, request, num_computed_tokens // self._block_size)
        needed = blocks_to_admit(request.num_tokens, self._block_size, in_use)
        now = time.perf_counter()
        since = self._unadmitted.setdefault(request.request_id, now)
        free = free_blocks(pool)
        shortfall = admission_shortfall(
            needed, free, now - since, self._scheduled_nothing, self.settings.reclaim_retry_s
        )
        if shortfall > 0 >= needed - free and request.request_id not in self._starved:
            self._starved.add(request.request_id)
            log.info(
                "kvbroker: request %s waited %.1f s on an idle engine although %d free blocks "
                "cover the %d it needs by the connector's count; releasing retention for it",
                request.request_id, now - since, free, needed,
            )  # fmt: skip
        self._shortfall_blocks = max(self._shortfall_blocks, shortfall)

    def has_pending_block_frees(self) -> bool:
        """Asked by the scheduler when a running request cannot grow, before it preempts one:
        reclaim retained blocks instead, and have it wait for them while they are coming."""
        self._shortfall_blocks = max(self._shortfall_blocks, 1)
        now = time.perf_counter()
        self._reclaim(now)
        retry = self.settings.reclaim_retry_s
        pending = any(r.being_reclaimed(now, retry) for r in self._retained.values())
        return pending or super().has_pending_block_frees()

    def _match(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params is not None and vllm_compat.remote_read_attempted(params):
            # A read was already attempted for this request (it failed, or the request was
            # preempted after it): vLLM 0.32 would report the remote tokens again without
            # starting a new read, leaving the request waiting forever. Recompute instead.
            handles.strip_handle(params)
        if not settle_match(
            self._pending_matches,
            self.link,
            request,
            params,
            _session(request),
            num_computed_tokens,
            self.settings,
            self._block_size,
        ):
            return None, False  # the match by content is in flight: "not known yet"
        if params is not None and not settle_remote(
            self._pending_checks,
            self.link,
            request,
            params,
            num_computed_tokens,
            self.settings,
            self._block_size,
            self._metrics.settled,
        ):
            return None, False  # vLLM 0.32: "not known yet"; it asks again next step
        matched, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if matched == 0 and params and params.get(handles.DECODE_LOCAL_KEY):
            tail = self._tail.match(request, num_computed_tokens, _session(request), self._copyable)
            return tail, False
        return matched, load_async

    def _copyable(self, request_id: str) -> bool:
        """Whether a retained tail's request is a source to copy from: not if its free is due
        or being asked for (``engine_ext.retained_tail``)."""
        retained = self._retained.get(request_id)
        return (
            retained is not None
            and retained.deadline > time.perf_counter()
            and retained.reclaim_asked_at is None
        )

    # ------------------------------------------------------------ decode side

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        coalesce_destination(getattr(self, "_kv_cache_manager", None), self._sched, request)
        read = issued_read(self._sched, request)  # its blocks and runs (engine_ext.fragmentation)
        if read is not None:
            self._metrics.read(read)
        self._tail.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)
        self._unadmitted.pop(request.request_id, None)
        self._starved.discard(request.request_id)
        params = request.kv_transfer_params
        if params and params.get(handles.DECODE_LOCAL_KEY):
            # A turn on the decode node alone sets neither transfer flag, so vLLM does not
            # take it into its transfer path; it is retained like a decode leg when it
            # finishes, and only a request the worker tracks can ever be freed.
            vllm_compat.track_for_free(self._sched, request.request_id)
        if vllm_compat.in_transfer_batch(self._sched, request.request_id):
            self._tracked.add(request.request_id)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        finished = self._finished(request, block_ids)
        session = _session(request)
        out = finished[1]
        if out is not None and params and params.get("do_remote_decode"):
            if session:
                # P's leg: the decode engine retains the turn under the conversation even when
                # the router gave it no session id.
                out[handles.SESSION_KEY] = session
            read_by_content = handles.content_read_tokens(params)
            if read_by_content:
                # The router planned the turn as new: it learns of the read by content so
                # (from P's leg only: a decode leg that a foreign router relayed it to is mute).
                out[handles.CONTENT_READ_KEY] = read_by_content
        if (
            self.link is not None
            and session
            and params
            and not params.get("do_remote_decode")  # P's leg: D ends the turn
            and request.request_id not in self._retained
        ):
            self.link.not_retained(
                session, vllm_compat.end_without_retention(request, self._retains)
            )
        return finished

    def _finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        # Finished (e.g. aborted) while its lease check was in flight: nothing will ask again.
        self._pending_checks.pop(request_id, None)
        self._pending_matches.pop(request_id, None)
        end_pin(self.link, request.kv_transfer_params)  # its read, if any, is over
        self._tail.finished(request_id)
        self._unadmitted.pop(request_id, None)
        self._starved.discard(request_id)
        tracked = request_id in self._tracked
        self._tracked.discard(request_id)
        params = request.kv_transfer_params
        in_transfer_path = params and (
            params.get("do_remote_decode") or params.get("do_remote_prefill")
        )
        if params and not tracked and not in_transfer_path:
            # Params that never entered the transfer path (neither flag set, or a DECODE_LOCAL
            # turn that never ran): vLLM would retain the blocks with a deadline its worker
            # never applies. Free them now.
            return False, None
        delay_free, out = self._sched.request_finished(request, block_ids)
        is_decode_retention = bool(delay_free and out and out.get("do_remote_decode"))
        if not is_decode_retention:
            return delay_free, out
        if not tracked:
            # The worker never saw it (update_state_after_alloc): it would drop every deadline
            # given for it, so retaining it would hold its blocks for good.
            log.warning("kvbroker: not retaining %s: vLLM's worker does not track it", request_id)
            return False, None
        assert out is not None
        session = _session(request)
        if not session or self.link is None or self._departing:
            # Nothing can ask for this KV again (or the engine is stopping): let the worker
            # free it at the next step.
            vllm_compat.free_at(self._sched, request_id, time.perf_counter())
            return delay_free, None
        num_tokens = int(out["remote_num_tokens"])
        now = time.perf_counter()
        first = first_deadline(now, self.settings.hard_cap_s)
        self._retained[request_id] = RetainedRequest(
            request_id=request_id,
            tokens=num_tokens,
            block_ids=frozenset(block_ids[0]) if block_ids else frozenset(),
            hard_cap=first.hard_cap,
            deadline=first.free_at,
            last_active=now,
            ttl_s=self.settings.hard_cap_s,
        )
        self._tail.keep(session, request, num_tokens, block_ids[0])
        checkpoints = Checkpoints.of(
            prefix_hashes(request.all_token_ids, self._block_size, num_tokens)
        )
        # No time_to_live: the lease's lifetime is the registry's idle TTL, not the hard cap.
        self.link.retained(
            registry_pb2.RetainedBlocks(
                conversation_id=session,
                handle=handles.handle_from_params(out),
                block_hashes=checkpoints.hashes,
                block_hash_stride=checkpoints.stride,
                token_count=num_tokens,
            )
        )
        return delay_free, out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        self._apply_deadlines()
        if self._departing or self._idle.stopping():
            self._depart(time.perf_counter())
        self._reclaim(time.perf_counter())
        meta = super().build_connector_meta(scheduler_output)
        self._tail.hand_over(meta)
        self._scheduled_nothing = scheduler_output.total_num_scheduled_tokens == 0
        if self._scheduled_nothing and not self._departing:
            self._idle.pause()
        return meta

    def _depart(self, now: float) -> None:
        """The engine core was asked to stop, and it exits only once no finished request
        holds blocks: retention ends now. Each retained request's hard cap becomes now, so the
        worker frees its blocks at this step, and its free is reported to the registry as any
        other (``update_connector_output``): the lease ends RELEASED, cause ENGINE (the engine
        freed the blocks on its own), unless the registry had ended it already."""
        if not self._departing:
            self._departing = True
            log.info("kvbroker: the engine is stopping; freeing %d retained", len(self._retained))
        for retained in self._retained.values():
            if retained.hard_cap > now:
                retained.hard_cap = retained.deadline = now
                vllm_compat.free_at(self._sched, retained.request_id, now)

    def _apply_deadlines(self) -> None:
        """The lease's deadlines become the worker's deadlines, never past the hard cap."""
        if self.link is None:
            return
        now_mono, now = time.monotonic(), time.perf_counter()
        for deadline in self.link.poll_deadlines():
            retained = self._retained.get(deadline.remote_request_id)
            if retained is None:
                continue
            left = max(deadline.expires_at - now_mono, 0.0)
            updated = next_deadline(
                RetentionDeadline(hard_cap=retained.hard_cap, free_at=retained.deadline),
                LeaseDeadline(live=deadline.lease_live, time_left_s=left),
                now,
                self.settings.hard_cap_s,
            )
            retained.hard_cap, retained.deadline = updated.hard_cap, updated.free_at
            if deadline.lease_live:
                # A grant or renewal restarts the conversation's idle clock.
                retained.last_active, retained.ttl_s = now, left
                # A CLAIMED answer (to a reclaim, or a claim that moved the expiry): a read
                # may be in flight, so it is not asked for again until then.
                if deadline.state == lease_pb2.LEASE_STATE_CLAIMED:
                    retained.claimed_until = now + left
                    retained.reclaim_asked_at = None
            else:
                retained.end_cause = deadline.cause
            vllm_compat.free_at(self._sched, deadline.remote_request_id, retained.deadline)

    def _reclaim(self, now: float) -> None:
        """Asks the registry to release the lowest-value retained requests that cover this
        step's shortfall of free blocks and keep retention within its budget."""
        shortfall, self._shortfall_blocks = self._shortfall_blocks, 0
        if self.link is None or not self._retained or not self.settings.pressure_release:
            return
        if self._departing:  # everything retained is being freed already
            return
        chosen = choose_reclaims(
            self._retained.values(),
            now,
            shortfall,
            self._budget_blocks,
            self.settings.reclaim_retry_s,
        )
        for retained, cause in chosen:
            retained.reclaim_asked_at = now
            self.link.reclaim(retained.request_id, cause)  # type: ignore[arg-type]
        if chosen:
            log.info(
                "kvbroker reclaiming %d requests (%d blocks): shortfall %d blocks, %d retained",
                len(chosen),
                sum(r.blocks for r, _ in chosen),
                shortfall,
                len(self._retained),
            )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        now = time.perf_counter()
        for request_id in connector_output.finished_sending or ():
            self._tail.freed(request_id)
            retained = self._retained.pop(request_id, None)
            if retained is not None and self.link is not None:
                cause = end_cause_of_free(retained, now)
                self._metrics.freed(cause)
                self.link.released(
                    request_id,
                    "freed by the engine: " + lease_pb2.LeaseEndCause.Name(cause),
                    cause,  # type: ignore[arg-type]
                )

    # ------------------------------------------------------------ metrics

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """vLLM asks both sides every step: a worker ships NIXL's transfer stats, the scheduler
        side kvbroker's retention and reads (``engine_ext.connector_metrics``)."""
        if self.role == KVConnectorRole.WORKER:
            return worker_stats(super().get_kv_connector_stats())
        gauges = retention_gauges(self._retained.values(), self._budget_blocks, time.perf_counter())
        return self._metrics.take(gauges)

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._tail.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """A step's retained-tail copies land before its forward pass reads them."""
        self._tail.copy(self._get_connector_metadata())
        super().start_load_kv(forward_context, **kwargs)

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
        super().shutdown()


def _session(request: Request) -> str | None:
    """The conversation a request belongs to (``handles.session_of``)."""
    return handles.session_of(vllm_compat.session_id(request), request.kv_transfer_params)
