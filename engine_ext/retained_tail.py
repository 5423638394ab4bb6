"""A DECODE_LOCAL turn's reuse of the KV that vLLM's prefix cache cannot give back: its
conversation's retained tail.

vLLM's prefix cache matches whole blocks only. The last block of a finished turn (the end of
its prompt and the start of its answer, or the whole of a short answer) is not full, so it is
never cached, and the next turn on the same engine recomputes those tokens although the
retained request still holds their KV in that block: half a block per turn on average, and
all of a short answer. On a long context each of them costs attention over the whole of it
(on the 2-core bench machine at 8k tokens, a DECODE_LOCAL turn after a 16-token answer
computed 46 to 68 tokens; with this, vLLM counted 6 to 28 of them as copied).

The connector offers those tokens to vLLM's scheduler as external tokens loaded
synchronously, so vLLM computes only from the first token the retained request does not
hold, and the worker copies the retained request's blocks that hold them into the new
request's own blocks before the step's forward pass (``vllm_compat.copy_kv_blocks``).

Why it is safe (where ``vllm_compat.tail_reuse_unsupported`` finds nothing against it:
one full-attention KV cache group, one batch in flight, no drafter):
- the KV of the matched tokens is the same in both requests: they agree on the adapter and
  cache salt, and no input but tokens (no embeddings, no images) is involved;
- the KV at a position depends only on the tokens up to it, and both requests agree on all
  of those: before the prefix-cache hit by the chained hash of its last block, after it
  token by token;
- the source blocks outlive the copy: a retained request's blocks are freed only after the
  worker has reported it done, and with one batch in flight that report comes after the
  forward pass of any step planned while the request was still retained; a tail whose free
  is due or being asked for is not copied from;
- the destination blocks are the new request's own, past its prefix-cache hit, so nobody
  else reads them; the tail of the last one copied is overwritten by the tokens computed
  after the match in the same step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetainedTail:
    """What a retained request's KV offers the next turn of its conversation (group 0)."""

    request_id: str
    # Its tokens, prompt and answer (vLLM's own list: nothing is copied).
    token_ids: Sequence[int]
    # How many of them have KV: the last sampled token was never run through the model.
    kv_tokens: int
    # Its blocks, in order.
    block_ids: tuple[int, ...]
    # vLLM's chained hashes of its full blocks.
    block_hashes: Sequence[object]
    # What else its KV depends on (``vllm_compat.token_identity``); None: not tokens alone.
    identity: Hashable | None


class RetainedTails:
    """The retained tail of each conversation's last turn, by conversation, and the
    conversation of each by request id: a later turn's tail replaces the earlier one, and a
    freed request takes its tail with it."""

    def __init__(self) -> None:
        self._by_session: dict[str, RetainedTail] = {}
        self._sessions: dict[str, str] = {}

    def get(self, session: str) -> RetainedTail | None:
        return self._by_session.get(session)

    def keep(self, session: str, tail: RetainedTail) -> None:
        previous = self._by_session.get(session)
        if previous is not None:
            self._sessions.pop(previous.request_id, None)
        self._by_session[session] = tail
        self._sessions[tail.request_id] = session

    def forget(self, request_id: str) -> None:
        session = self._sessions.pop(request_id, None)
        if session is not None:
            self._by_session.pop(session, None)


@dataclass(frozen=True, slots=True)
class TailPlan:
    """Tokens ``[start, start + count)`` of a request come from the tail's KV."""

    tail: RetainedTail
    start: int
    count: int


def tail_match(
    prompt: Sequence[int],
    prompt_hashes: Sequence[object],
    identity: Hashable | None,
    start: int,
    tail: RetainedTail,
    block_size: int,
) -> int:
    """How many tokens from ``start`` (where the prompt's prefix-cache hit ends, on a block
    boundary) the tail's KV gives the prompt: 0 unless both have the same identity (what else
    the KV depends on; None never matches) and agree on everything before ``start``, then the
    run of tokens both agree on, ending at the last the tail has KV for and always one short
    of the prompt's end (vLLM samples from the last token's pass)."""
    if identity is None or identity != tail.identity or start % block_size:
        return 0
    hit_blocks = start // block_size
    if hit_blocks and (
        len(tail.block_hashes) < hit_blocks
        or len(prompt_hashes) < hit_blocks
        or tail.block_hashes[hit_blocks - 1] != prompt_hashes[hit_blocks - 1]
    ):
        return 0
    end = min(len(prompt) - 1, tail.kv_tokens, len(tail.token_ids))
    matched = start
    while matched < end and prompt[matched] == tail.token_ids[matched]:
        matched += 1
    return matched - start


def tail_copies(plan: TailPlan, block_ids: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """(source, destination) block ids that carry the plan's tokens into a request whose
    blocks are ``block_ids``: the same block positions, since the tokens keep theirs."""
    if plan.count <= 0:
        return []
    first = plan.start // block_size
    last = (plan.start + plan.count - 1) // block_size
    return [(plan.tail.block_ids[j], block_ids[j]) for j in range(first, last + 1)]
