"""The registry's prefix index: live leases found by content, so that a fork reuses what its
parent retained (docs/design.md, "Forks: reuse by content").

A sub-agent's prompt is its parent's whole history plus its own task, under a new session id:
reuse by session id finds nothing, though the parent's lease holds every block of that history.
The prefill engine, which has the prompt's token ids, computes kvbroker's prefix hashes
(chained sha256, deterministic across processes) and asks for the longest live lease whose
hashes equal its own. Hashes chain, so one equal hash at block i proves blocks 0..i equal; the
index therefore keys each lease only by its hashes at block indexes 2^k - 1
(``checkpoints.probe_blocks``) that are among its checkpoints (every one at or past its
stride, as the stride is a power of two), of full blocks only. A lease costs about
log2(blocks) entries (14 for 8,192 blocks), and a look-up about as many dictionary probes.

Scope: a lease is found only under its tenant (the conversation id's ``TENANT/`` prefix,
``tenants.tenant_of``), its holder's model and its block size, so no tenant's look-up can name
another's lease. Maintained from one place, ``Leases._track``, which every change of a lease's
state passes through (grant, claim, end, revival, a takeover's rebuild): a live lease is
indexed, an ended one removed. Soft state, as leases are: rebuilt from the replays.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvbroker.common.rules.checkpoints import checkpoint_blocks, probe_blocks
from kvbroker.controlplane.records import codec

# The most probe hashes a look-up may carry: 2^31 blocks, far past any context.
MAX_PROBES = 32
# The leases a key keeps, newest: they all give a prompt the same prefix there.
KEEP_PER_KEY = 8
# The bytes of a probe hash a key keeps, as an int: below 2**60 a Python int is 32 bytes (an
# 8-byte bytes object 48), and a registry holds millions of keys.
KEY_BYTES = 7


def key_of(digest: bytes) -> int:
    """A probe hash's key: its first ``KEY_BYTES`` bytes."""
    return int.from_bytes(digest[:KEY_BYTES])


@dataclass(frozen=True, slots=True)
class Scope:
    """What a look-up may match: one tenant's leases of one model at one block size."""

    tenant: str
    model: str
    block_size: int


@dataclass(frozen=True, slots=True)
class Hit:
    """Leases whose hash at block ``2**level - 1`` equals the prompt's: they share its first
    ``blocks`` blocks."""

    blocks: int
    lease_ids: tuple[str, ...]


def indexed_hashes(
    checkpoints: bytes, stride: int, token_count: int, block_size: int
) -> list[tuple[int, bytes]]:
    """A lease's (block index, hash) pairs the index keys it by: its checkpoints at probe
    blocks, of full blocks only (a partial last block's hash covers fewer tokens than any
    prompt's block there)."""
    if block_size <= 0 or token_count <= 0:
        return []
    hashes = codec.checkpoint_hashes(checkpoints)
    block_count = -(-token_count // block_size)
    positions = checkpoint_blocks(block_count, max(stride, 1))
    full_blocks = token_count // block_size
    at = dict(zip(positions, hashes, strict=False))
    return [(b, at[b]) for b in probe_blocks(full_blocks) if b in at]


class PrefixIndex:
    """Live leases by (scope, hash at a probe block).

    Bounded by what a look-up can use. Leases that share a key share every block up to it
    (hashes chain), so any of them gives a prompt the same prefix there: a key keeps only its
    ``KEEP_PER_KEY`` newest leases (the spares are for when the newest cannot be read). One
    system prompt under a million conversations is then 8 ids at each of its keys, not a
    million, and a look-up reads at most 8 leases a level. A key is the hash's first
    ``KEY_BYTES`` bytes (``key_of``): a lease costs about 80 bytes a key here at any context
    length, and a collision (one in 2^56 a probe) costs nothing but a lease the reader's check
    against its checkpoints turns down."""

    def __init__(self) -> None:
        # Per scope, each key's leases, newest last: one id alone (the common case, a key no
        # other lease shares) as a str, several in a list.
        self._leases: dict[Scope, dict[int, str | list[str]]] = {}
        # One object per scope, shared by its leases (a lease's own would cost ~110 bytes).
        self._scopes: dict[Scope, Scope] = {}
        # Each indexed lease's scope and its last (longest) key, the key objects ``_leases``
        # holds. Its other keys are not kept: ``remove`` is given its hashes again, which
        # are the lease's own (its checkpoints never change).
        self._keys: dict[str, tuple[Scope, int]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._keys

    def entries(self) -> int:
        """Lease ids held under keys in all: about log2(blocks) per lease, fewer where many
        leases share a key."""
        return sum(
            1 if isinstance(ids, str) else len(ids)
            for keys in self._leases.values()
            for ids in keys.values()
        )

    def scope(self, lease_id: str) -> Scope | None:
        """The scope an indexed lease is found under; None when it is not indexed."""
        found = self._keys.get(lease_id)
        return found[0] if found is not None else None

    def add(self, lease_id: str, scope: Scope, hashes: Sequence[tuple[int, bytes]]) -> None:
        """Indexes a live lease (again: a no-op) under its ``indexed_hashes``."""
        if lease_id in self._keys:
            return
        scope = self._scopes.setdefault(scope, scope)
        by_key = self._leases.setdefault(scope, {})
        key = -1
        for _, digest in hashes:
            key = key_of(digest)
            ids = by_key.get(key)
            if ids is None:
                by_key[key] = lease_id
            elif isinstance(ids, str):
                by_key[key] = [ids, lease_id]
            else:
                ids.append(lease_id)
                if len(ids) > KEEP_PER_KEY:
                    del ids[0]
        self._keys[lease_id] = (scope, key)

    def remove(self, lease_id: str, hashes: Sequence[tuple[int, bytes]]) -> None:
        """Forgets an indexed lease; ``hashes``: what it was added under."""
        found = self._keys.pop(lease_id, None)
        if found is None:
            return
        scope = found[0]
        by_key = self._leases.get(scope, {})
        for _, digest in hashes:
            key = key_of(digest)
            ids = by_key.get(key)
            if ids == lease_id:
                del by_key[key]
            elif isinstance(ids, list) and lease_id in ids:
                ids.remove(lease_id)
                if len(ids) == 1:
                    by_key[key] = ids[0]
        if not by_key:
            self._leases.pop(scope, None)
            self._scopes.pop(scope, None)

    def clear(self) -> None:
        self._leases.clear()
        self._scopes.clear()
        self._keys.clear()

    def sharing_all(self, scope: Scope, hashes: Sequence[tuple[int, bytes]]) -> list[str]:
        """The leases whose every indexed hash is among ``hashes`` (a lease's own
        ``indexed_hashes``): hashes chain, so those whose longest indexed key (the last of
        their keys) is one of them. The candidates a sessionless lease may supersede; a lease
        sharing only a shorter prefix (a common system prompt) is not among them."""
        by_key = self._leases.get(scope)
        if by_key is None:
            return []
        found: set[str] = set()
        for _, digest in hashes:
            key = key_of(digest)
            ids = by_key.get(key)
            for lease_id in (ids,) if isinstance(ids, str) else ids or ():
                if self._keys[lease_id][1] == key:
                    found.add(lease_id)
        return sorted(found)

    def hits(self, scope: Scope, probes: Sequence[bytes]) -> Iterator[Hit]:
        """The leases sharing the prompt's prefix, longest share first, newest lease first
        within one: ``probes`` are the prompt's hashes at blocks 0, 1, 3, 7, ... in order."""
        by_key = self._leases.get(scope)
        if by_key is None:
            return
        for level in range(min(len(probes), MAX_PROBES) - 1, -1, -1):
            ids = by_key.get(key_of(probes[level]))
            if ids is not None:
                yield Hit(1 << level, (ids,) if isinstance(ids, str) else tuple(reversed(ids)))
