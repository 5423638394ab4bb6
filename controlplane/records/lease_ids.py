"""What a lease is named and numbered by: lease ids, and the epochs that fence stale reads.

Apart from the lessor because more than it depends on them: validation accepts only ids of
this shape, and the fencing argument (docs/design.md, "The fencing argument") rests on
``next_epoch`` alone.
"""

from __future__ import annotations

import secrets

# Epochs carry the term of the registry that granted them above this many bits: a million
# grants of one conversation under one term before its count could reach a later term's floor
# (a term in milliseconds, 44 bits until the year 2527, still leaves the epoch within 64).
TERM_SHIFT = 20


def next_epoch(epoch: int, term: int) -> int:
    """The epoch of a conversation's next grant: above its current ``epoch``, and at least
    ``term``'s floor, so that every epoch a later term grants exceeds every epoch an earlier
    one did, whatever the later registry remembers (a successor replica, a restarted
    standalone registry: both rebuild conversations from replays that may come after their
    first grants)."""
    return max(epoch + 1, term << TERM_SHIFT)


def new_lease_id(now: float) -> str:
    """Milliseconds then randomness: unique, and sorts in grant order for listings and paging."""
    return f"{int(now * 1000):011x}{secrets.token_hex(5)}"
