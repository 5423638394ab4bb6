"""Prompt-size estimates (``kvbroker/common/rules/prompt_size.py``): the new suffix is what follows
the last answer, and the characters-to-tokens ratio is learned from prefill legs."""

from __future__ import annotations

from kvbroker.common.rules.prompt_size import TOKENS_PER_MESSAGE, PromptSize, PromptText

CHAT = {
    "messages": [
        {"role": "system", "content": "s" * 400},
        {"role": "user", "content": "u" * 4000},
        {"role": "assistant", "content": "a" * 800},
        {"role": "user", "content": "q" * 80},
        {"role": "tool", "content": [{"type": "text", "text": "t" * 120}, {"type": "image"}]},
    ]
}


def test_the_suffix_is_what_follows_the_last_answer() -> None:
    text = PromptText.of(CHAT)
    assert (text.chars, text.messages) == (400 + 4000 + 800 + 80 + 120, 5)
    assert (text.new_chars, text.new_messages) == (200, 2)
    first_turn = PromptText.of({"messages": CHAT["messages"][:2]})
    assert first_turn.new_chars == first_turn.chars  # no answer yet: all of it is new
    raw = PromptText.of({"prompt": "x" * 100})
    assert (raw.chars, raw.new_messages) == (100, 0)
    assert PromptText.of({"messages": "not a list"}).chars == 0


def test_the_ratio_is_learned_from_what_prefill_legs_counted() -> None:
    size = PromptSize()
    text = PromptText.of(CHAT)
    framing = text.messages * TOKENS_PER_MESSAGE
    size.learn(text, prompt_tokens=round(text.chars / 3) + framing)  # 3 chars a token
    assert abs(size.tokens_per_char - 1 / 3) < 1e-3
    total, new = size.estimate(text)
    assert abs(total - (round(text.chars / 3) + framing)) <= 1
    assert new == round(200 / 3) + 2 * TOKENS_PER_MESSAGE
    size.learn(text, prompt_tokens=1)  # nonsense (under the framing alone): ignored
    assert abs(size.tokens_per_char - 1 / 3) < 1e-3
    size.learn(text, prompt_tokens=round(text.chars / 4) + framing)
    assert 0.25 < size.tokens_per_char < 1 / 3  # moves, smoothed
