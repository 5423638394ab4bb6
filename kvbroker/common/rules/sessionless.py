"""Sessionless turns: the conversation ids kvbroker names for turns that come with none, and
when such a conversation's new lease makes an older one redundant (docs/design.md, "Forks:
reuse by content", sessionless turns).

A plain OpenAI client (or NVIDIA AIPerf at its defaults) sends no session id. Without one,
the decode node retains nothing and the next turn has nothing to match by content, so every
turn computes its whole history. kvbroker's router therefore names each sessionless turn: a
fresh id in a namespace of its own (``new_session_id``), scoped to the client's tenant like
any session id, so the decode node retains the turn under a lease and the client's next
sessionless turn finds it by content at the prefill engine.

Each such turn is a new conversation, so without more, every turn would leave a lease behind
it: a chain of ever longer copies of one history. The registry ends the chain as it grows
(``Leases.grant``): a sessionless turn's new lease that holds the whole of what an older
sessionless lease of the same tenant can be read for (``holds_all_of``) supersedes it. A lease
the new one shares only a part of (two conversations with one system prompt, RL rollouts from
one prompt) is left alone: it is another conversation, forked from the same opening. A lease of
an explicit session is never taken over (``may_take_over``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvbroker.common.rules.checkpoints import checkpoint_blocks
from kvbroker.common.rules.tenants import Tenant, tenant_of

# The session ids kvbroker names begin so (a client's rarely do, and a client that adopts one
# from the answer's header continues that conversation by its id). No "/": the tenant rule
# reads the part before the first one as a tenant.
NAMESPACE = "~kvbroker-sessionless-"


def new_session_id() -> str:
    """A fresh session id in kvbroker's namespace (scope it to the client's tenant)."""
    return NAMESPACE + uuid.uuid4().hex


def is_sessionless(conversation_id: str) -> bool:
    """Whether the conversation is one kvbroker named for a turn that came without an id:
    the session part of the id (after its tenant's prefix) is in the namespace."""
    session = conversation_id.removeprefix(Tenant(tenant_of(conversation_id)).prefix)
    return session.startswith(NAMESPACE)


def may_take_over(old_conversation: str, new_conversation: str) -> bool:
    """Whether a lease of ``new_conversation`` may supersede a lease of ``old_conversation``
    by content: both named by kvbroker for sessionless turns, of one tenant, and not one
    conversation (that one supersedes its own leases by its epochs)."""
    return (
        old_conversation != new_conversation
        and is_sessionless(old_conversation)
        and is_sessionless(new_conversation)
        and tenant_of(old_conversation) == tenant_of(new_conversation)
    )


@dataclass(frozen=True, slots=True)
class Retained:
    """A lease's content as the registry knows it: its checkpoint hashes at ``stride``, over
    ``token_count`` tokens."""

    hashes: Sequence[bytes]
    stride: int
    token_count: int

    def checkpoints(self, block_size: int) -> dict[int, bytes]:
        """Block index -> prefix hash, for its checkpoints of full blocks only (a partial last
        block's hash covers fewer tokens than a longer content's block there)."""
        blocks = -(-self.token_count // block_size)
        full = self.token_count // block_size
        positions = checkpoint_blocks(blocks, max(self.stride, 1))
        return {b: h for b, h in zip(positions, self.hashes, strict=False) if b < full}


def holds_all_of(new: Retained, old: Retained, block_size: int) -> bool:
    """Whether ``new`` holds everything ``old`` can be read for: its prefix hash at ``old``'s
    last checkpoint of a full block equals ``old``'s (hashes chain, so every block before it is
    equal too). A reader verifies a lease only through its checkpoints, so nothing past that
    one is ever read from ``old``. False when ``new`` keeps no checkpoint at that block (its
    stride skips it), or ``old`` has no full block (nothing of it can be read by content)."""
    if block_size <= 0:
        return False
    theirs = old.checkpoints(block_size)
    if not theirs:
        return False
    last = max(theirs)
    ours = new.checkpoints(block_size).get(last)
    return ours is not None and ours == theirs[last]
