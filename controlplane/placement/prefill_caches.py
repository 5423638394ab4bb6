"""What the prefill nodes' own prefix caches hold of each conversation, as far as the registry
knows: the prefill node that computed the conversation's last prompt, and that prompt's
length (the router's estimate). With vLLM's prefix caching on, that node still caches the
prompt on the next turn and computes (or reads) only what lies beyond it, which the planner
weighs (``controlplane/placement/planner.py``).

Soft state, in the leader's memory only: a successor starts without it, and the planner then
routes as if no prefill node cached anything (never wrong, only slower). It is a fact about
an engine's cache, which evicts by its own LRU policy, so it is kept for the most recently
prefilled conversations only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kvbroker.common.rules.routing import RoutedNode, routable
from kvbroker.v1 import node_pb2

# Conversations remembered; the least recently prefilled is forgotten first. A prefill
# engine's cache holds far fewer prompts than this.
MAX_CONVERSATIONS = 1 << 17

N = TypeVar("N", bound="RoutedNode[Any]")


@dataclass(frozen=True, slots=True)
class CachedPrompt:
    node_id: str
    # The engine it was computed on: a restarted engine has an empty cache.
    incarnation: str
    tokens: int


class PrefillCaches:
    def __init__(self, capacity: int = MAX_CONVERSATIONS) -> None:
        self._capacity = capacity
        # Insertion order is recency: a prefill moves its conversation to the end.
        self._prompts: dict[str, CachedPrompt] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def computed(self, conversation_id: str, prefill: node_pb2.NodeSpec, tokens: int) -> None:
        """A hint sent a prompt of ``tokens`` tokens of the conversation to ``prefill``."""
        self._prompts.pop(conversation_id, None)
        self._prompts[conversation_id] = CachedPrompt(prefill.node_id, prefill.incarnation, tokens)
        if len(self._prompts) > self._capacity:
            del self._prompts[next(iter(self._prompts))]

    def cached(
        self, conversation_id: str, model: str, nodes: Mapping[str, N]
    ) -> tuple[N, int] | None:
        """The prefill node whose own cache holds the conversation's last prompt, and that
        prompt's tokens; None unless that node is still the engine that computed it (the same
        incarnation), says its engine caches prefixes, and may take the turn (READY)."""
        prompt = self._prompts.get(conversation_id)
        if prompt is None:
            return None
        node = nodes.get(prompt.node_id)
        if (
            node is None
            or not node.prefills
            or not node.spec.prefix_caching
            or node.spec.incarnation != prompt.incarnation
            or not routable(node, model)
        ):
            return None
        return node, prompt.tokens
