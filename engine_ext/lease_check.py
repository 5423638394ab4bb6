"""The prefill side's lease check on a remote handle, kept off vLLM's scheduler thread.

vLLM asks the connector what a waiting request can load (``get_num_new_matched_tokens``) on
its scheduler thread, every step, and needs the answer at once; whether the handle may be read
is the registry's to say, a round trip away through the sidecar. So the first ask starts the
check on the sidecar link's thread and each later ask looks at where it got to: until it has
answered, or its bound has passed, the request is "not known yet" and waits while the
scheduler goes on. The rule applied to the answer is ``engine_ext.verdict``; this module owns
the checks in flight and what a settled verdict does to the request's transfer params.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from kvbroker.common.client.engine_link import EngineLink, LeaseAnswer
from kvbroker.common.rules import handles
from kvbroker.engine_ext import vllm_compat
from kvbroker.engine_ext.prefix import verified_prefix_tokens
from kvbroker.engine_ext.prefix_match import FORK_KEY
from kvbroker.engine_ext.settings import KvBrokerSettings
from kvbroker.engine_ext.verdict import (
    LeaseCheck,
    RemoteOffer,
    Verdict,
    remote_verdict,
    worth_reading,
)
from kvbroker.engine_ext.vllm_compat import Request

log = vllm_compat.engine_logger("lease_check")

_CHECKED_KEY = "_kvbroker_checked"


@dataclass(slots=True)
class PendingCheck:
    """A handle whose lease check is in flight (``asked_at`` on ``time.monotonic``)."""

    offer: RemoteOffer
    asked_at: float
    answer: Future[LeaseAnswer]

    def check(self) -> LeaseCheck:
        if not self.answer.done():
            return LeaseCheck(self.asked_at)
        if self.answer.cancelled() or self.answer.exception() is not None:
            # The link's loop went away under the call.
            lost = LeaseAnswer(False, "lease check lost with the sidecar link", from_registry=False)
            return LeaseCheck(self.asked_at, lost)
        return LeaseCheck(self.asked_at, self.answer.result())


def settle_remote(
    pending_checks: dict[str, PendingCheck],
    link: EngineLink | None,
    request: Request,
    params: dict[str, Any],
    num_computed_tokens: int,
    settings: KvBrokerSettings,
    block_size: int,
    settled: Callable[[Verdict], None],
) -> bool:
    """Keeps the request's handle only if it is safe and worth reading, trimmed to the verified
    prefix; a removed handle means vLLM recomputes and never touches the decode node. False
    while the lease check is still in flight (its entry in ``pending_checks`` until then);
    True at once for params without a handle or with one already settled. ``settled`` hears
    each handle's verdict once, when it settles (the engine's metrics count them)."""
    has_handle = bool(params.get("do_remote_decode") and params.get("remote_block_ids"))
    if not has_handle or params.get(_CHECKED_KEY):
        return True
    request_id = request.request_id
    now = time.monotonic()
    wait_s = settings.lease_check_timeout_s
    pending = pending_checks.get(request_id)
    check: LeaseCheck | None = None
    if pending is not None:
        # The local prefix cache may have grown since the first ask.
        offer = replace(pending.offer, local_tokens=num_computed_tokens)
        check = pending.check()
    else:
        offer = _offer(request, params, num_computed_tokens, settings, block_size)
        if link is not None and worth_reading(offer) is None:
            pending = PendingCheck(
                offer=offer,
                asked_at=now,
                answer=link.start_lease_check(
                    str(params[handles.LEASE_ID_KEY]), int(params[handles.EPOCH_KEY]), wait_s
                ),
            )
            pending_checks[request_id] = pending
            check = pending.check()
    decision = remote_verdict(offer, check, now, wait_s)
    if decision.verdict is Verdict.WAIT:
        return False
    pending_checks.pop(request_id, None)
    params[_CHECKED_KEY] = True
    settled(decision.verdict)
    if decision.verdict is not Verdict.READ:
        log.info(
            "kvbroker remote KV not read for %s (%s): %s",
            request_id,
            decision.verdict.value,
            decision.reason,
        )
        handles.strip_handle(params)
        return True
    params["remote_num_tokens"] = offer.verified_tokens
    shared = check is not None and check.answer is not None and check.answer.shared
    if shared or params.get(FORK_KEY):
        # Forks read this lease by content: the read leaves the blocks to the registry.
        vllm_compat.read_without_freeing(params)
    if params.get(FORK_KEY):
        params[handles.CONTENT_READ_KEY] = offer.verified_tokens
    blocks = -(-offer.verified_tokens // block_size)
    params["remote_block_ids"] = [list(group)[:blocks] for group in params["remote_block_ids"]]
    log.info(
        "kvbroker remote KV accepted for %s: %d tokens, %d cached locally",
        request_id,
        offer.verified_tokens,
        num_computed_tokens,
    )
    return True


def _offer(
    request: Request,
    params: dict[str, Any],
    num_computed_tokens: int,
    settings: KvBrokerSettings,
    block_size: int,
) -> RemoteOffer:
    """What the handle offers this prompt: its prefix as far as the block hashes verify."""
    remote_hashes = handles.checkpoints_from_params(params)
    carries_lease = bool(
        params.get(handles.LEASE_ID_KEY)
        and params.get(handles.EPOCH_KEY) is not None
        and remote_hashes is not None
    )
    verified = 0
    if remote_hashes is not None:
        prompt = request.prompt_token_ids or []
        remote_tokens = int(params.get("remote_num_tokens") or 0)
        verified = verified_prefix_tokens(remote_hashes, prompt, block_size, remote_tokens)
        # vLLM needs at least one prompt token computed here to sample from.
        verified = min(verified, len(prompt) - 1)
    return RemoteOffer(
        carries_lease=carries_lease,
        verified_tokens=verified,
        local_tokens=num_computed_tokens,
        recompute_threshold=settings.recompute_threshold,
    )
