"""The prefill side's match by content, kept off vLLM's scheduler thread: a fork reads what its
parent retained (docs/design.md, "Forks: reuse by content").

A turn of a conversation that has no retained KV of its own (a sub-agent under a new session
id, given its parent's whole history) reaches the prefill engine with no handle, and only the
engine has the prompt's token ids. So the engine asks: the prompt's prefix hashes at blocks
2^k - 1 (``checkpoints.probe_blocks``), through its sidecar, to the registry's MatchPrefix,
which answers a live lease of another conversation of the same tenant that the prompt starts
with, pinned for this read. The answer becomes the request's handle, as a hint's would be, and
from there the leg is a kvbroker-routed one (``engine_ext.lease_check``): the prefix verified
against the lease's checkpoints, the lease check, the read, or recompute. A read of a pinned
lease never frees the decode node's blocks (``vllm_compat.read_without_freeing``): the lease
is still its conversation's.

As for the lease check, the first ask starts the call on the sidecar link's thread and each
later ask looks at where it got to; until it has answered, or its bound has passed, the
request is "not known yet" and waits while the scheduler goes on. No answer in time, or none
at all, means the prompt is computed here: a match is never waited for beyond its bound.

Asked only for a prefill leg (``do_remote_decode``) with no handle, a session id (a request
without one is plain P/D: reuse off), the switch on (``KvBrokerSettings.prefix_match``) and a
prompt whose part past the local prefix-cache hit reaches ``kv_recompute_threshold``; once per
request.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvbroker.common.client.engine_link import EngineLink, PrefixAnswer
from kvbroker.common.rules import handles
from kvbroker.common.rules.checkpoints import probe_blocks
from kvbroker.engine_ext import vllm_compat
from kvbroker.engine_ext.prefix import prefix_hashes
from kvbroker.engine_ext.settings import KvBrokerSettings
from kvbroker.engine_ext.vllm_compat import Request
from kvbroker.v1 import registry_pb2

log = vllm_compat.engine_logger("prefix_match")

# Set once a request's match is settled (matched or not): it is asked once.
_MATCHED_KEY = "_kvbroker_prefix_matched"
# Set on a handle that came from a match: its read must not free the blocks.
FORK_KEY = "kvbroker_fork_read"
# The match's pin, [lease id, pin id], ended when the request finishes (``end_pin``).
PIN_KEY = "kvbroker_read_pin"


@dataclass(slots=True)
class PendingMatch:
    """A prompt whose match is in flight (``asked_at`` on ``time.monotonic``)."""

    asked_at: float
    answer: Future[PrefixAnswer]


def probes(prompt: list[int], block_size: int) -> list[bytes]:
    """The prompt's prefix hashes at blocks 0, 1, 3, 7, ... of its full blocks, short of its
    last token (P computes at least one token)."""
    full_blocks = (len(prompt) - 1) // block_size
    blocks = probe_blocks(full_blocks)
    if not blocks:
        return []
    hashes = prefix_hashes(prompt, block_size, (blocks[-1] + 1) * block_size)
    return [hashes[b] for b in blocks]


def wanted(
    params: dict[str, Any] | None,
    session: str | None,
    prompt_tokens: int,
    num_computed_tokens: int,
    settings: KvBrokerSettings,
) -> bool:
    """Whether this request asks for a match: a prefill leg with no handle, of a conversation,
    long enough past its local hit to be worth reading."""
    if not settings.prefix_match or not session or params is None:
        return False
    if params.get(_MATCHED_KEY) or not params.get("do_remote_decode"):
        return False
    if params.get("remote_block_ids") or params.get(handles.DECODE_LOCAL_KEY):
        return False
    return prompt_tokens - num_computed_tokens >= max(settings.recompute_threshold, 1)


def settle_match(
    pending: dict[str, PendingMatch],
    link: EngineLink | None,
    request: Request,
    params: dict[str, Any] | None,
    session: str | None,
    num_computed_tokens: int,
    settings: KvBrokerSettings,
    block_size: int,
) -> bool:
    """Gives a request with no handle the handle of the lease its prompt starts with, when the
    registry matches one. False while the match is in flight (its entry in ``pending`` until
    then); True once settled, or at once for a request that does not ask."""
    prompt = request.prompt_token_ids or []
    if link is None or not wanted(params, session, len(prompt), num_computed_tokens, settings):
        return True
    assert params is not None and session is not None
    request_id = request.request_id
    now = time.monotonic()
    wait_s = settings.lease_check_timeout_s
    asked = pending.get(request_id)
    if asked is None:
        hashes = probes(prompt, block_size)
        if not hashes:
            params[_MATCHED_KEY] = True
            return True
        asked = pending[request_id] = PendingMatch(
            now, link.start_prefix_match(session, block_size, hashes, wait_s)
        )
    if not asked.answer.done() and now - asked.asked_at < wait_s:
        return False  # "not known yet": the scheduler asks again next step
    pending.pop(request_id, None)
    params[_MATCHED_KEY] = True
    match = _answer(asked, wait_s)
    if match is None or not match.HasField("lease"):
        return True
    params.update(handles.prefill_params(match.lease))
    params[FORK_KEY] = True
    params[PIN_KEY] = [match.lease.lease_id, match.pin_id]
    log.info(
        "kvbroker prefix match for %s: lease %s of another conversation, %d blocks shared",
        request_id,
        match.lease.lease_id,
        match.matched_blocks,
    )
    return True


def _answer(asked: PendingMatch, wait_s: float) -> registry_pb2.MatchPrefixResponse | None:
    """The match, or None (logged) when none came in time."""
    future = asked.answer
    if not future.done():
        log.info("kvbroker prefix match unanswered after %gs: computed here", wait_s)
        return None
    if future.cancelled() or future.exception() is not None:
        return None
    answer = future.result()
    if answer.match is None:
        log.info("kvbroker prefix match not made: %s", answer.reason)
    return answer.match


def end_pin(link: EngineLink | None, params: dict[str, Any] | None) -> None:
    """A request a match pinned a lease for has finished, its read with it (read, declined or
    failed): the pin ends now rather than at its timeout, so the parent's blocks are again
    its holder's to release under pressure."""
    pin = params.pop(PIN_KEY, None) if params else None
    if link is not None and isinstance(pin, list) and len(pin) == 2 and all(pin):
        link.end_pin(str(pin[0]), str(pin[1]))
