"""How many tokens a turn's prompt has, and how many are new, estimated without a tokenizer:
what the registry's planner chooses the turn's path by. kvbroker's router estimates them, and
so does an engine that resolves its own handle behind another router
(``engine_ext/session_reuse.py``).

The new suffix is what follows the conversation's last answer: in a chat request, the
messages after the last assistant message (the retained KV covers everything up to the end
of that answer); in an Anthropic Messages or OpenAI Responses request the same, a Responses
function call counting as the model's answer. Only those few characters need converting to
tokens, so the estimate's error is a fraction of the suffix, not of the whole conversation.
The characters-to-tokens ratio is learned from the prefill legs, whose answers say exactly how
many prompt tokens P computed (``usage``), against the characters the router sent; a chat
template's framing is counted per message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A chat template's framing around each message (role markers, separators), in tokens.
TOKENS_PER_MESSAGE = 6
# Until a prefill leg has taught it: about four characters a token for English text under
# common BPE vocabularies.
INITIAL_TOKENS_PER_CHAR = 0.25
# How much one observation moves the learned ratio.
LEARNING_RATE = 0.2


@dataclass(frozen=True, slots=True)
class PromptText:
    """The characters of a request's prompt, all of it and the new suffix."""

    chars: int
    messages: int
    new_chars: int
    new_messages: int

    @classmethod
    def of(cls, body: dict[str, Any]) -> PromptText:
        """The prompt of a chat completion (``messages``), an Anthropic Messages request
        (``system`` beside ``messages``), a Responses request (``instructions`` beside
        ``input``, a string or items) or a completion (``prompt``)."""
        items = _items(body)
        if items is None:
            prompt = body.get("prompt")
            chars = len(prompt) if isinstance(prompt, str) else 0
            return cls(chars, 0, 0, 0)  # a raw prompt has no marked suffix
        sizes = [_message_chars(item) for item in items]
        last_answer = max((i for i, item in enumerate(items) if _is_answer(item)), default=-1)
        new = sizes[last_answer + 1 :]
        return cls(sum(sizes), len(sizes), sum(new), len(new))


def _items(body: dict[str, Any]) -> list[Any] | None:
    """The prompt's messages in order, the system prompt or instructions first (None: the
    request has none, a raw prompt)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = body.get("input")
        if isinstance(messages, str):  # Responses: one user message
            messages = [{"role": "user", "content": messages}]
        elif not isinstance(messages, list):
            return None
    preamble = body.get("system", body.get("instructions"))
    if isinstance(preamble, str | list):
        return [{"role": "system", "content": preamble}, *messages]
    return messages


# Responses items the model wrote (beside assistant messages): its tool calls and reasoning.
_ANSWER_ITEMS = frozenset({"function_call", "reasoning"})


def _is_answer(item: Any) -> bool:
    return isinstance(item, dict) and (
        item.get("role") == "assistant" or item.get("type") in _ANSWER_ITEMS
    )


def _message_chars(message: Any) -> int:
    """A message's (or a Responses item's) text: its content, a tool call's arguments or a
    tool's output."""
    if not isinstance(message, dict):
        return 0
    return sum(_text_chars(message.get(key)) for key in ("content", "arguments", "output"))


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts or blocks: count the text ones
        return sum(
            len(part["text"])
            if isinstance(part.get("text"), str)
            else _text_chars(part.get("content"))
            for part in content
            if isinstance(part, dict)
        )
    return 0


class PromptSize:
    """Estimates in tokens, with the characters-to-tokens ratio learned as turns go by."""

    def __init__(self) -> None:
        self.tokens_per_char = INITIAL_TOKENS_PER_CHAR
        self.observations = 0

    def tokens(self, chars: int, messages: int) -> int:
        return round(chars * self.tokens_per_char) + messages * TOKENS_PER_MESSAGE

    def estimate(self, text: PromptText) -> tuple[int, int]:
        """(prompt tokens, new tokens); new is 0 when the request marks no suffix."""
        new = self.tokens(text.new_chars, text.new_messages) if text.new_messages else 0
        return self.tokens(text.chars, text.messages), new

    def learn(self, text: PromptText, prompt_tokens: int) -> None:
        """A prefill leg computed ``prompt_tokens`` for ``text``."""
        framing = text.messages * TOKENS_PER_MESSAGE
        if text.chars <= 0 or prompt_tokens <= framing:
            return
        seen = (prompt_tokens - framing) / text.chars
        rate = 1.0 if self.observations == 0 else LEARNING_RATE
        self.tokens_per_char += rate * (seen - self.tokens_per_char)
        self.observations += 1
