"""What the end-to-end modules (``tests/test_e2e_*.py``) share, written once: their marks, the
module-scoped stack of real vLLM CPU engines their tests run against, and the text their
turns send. Each module still says its own configuration (the ``StackConfig`` settings it
passes) and its own time limit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from kvbroker_tools.stack import Stack, StackConfig
from kvbroker_tools.testmodel import corpus

MODEL = StackConfig.served_model
LINES = corpus(lines=400, seed=7)


def e2e_marks(timeout_s: int = 900) -> list[pytest.MarkDecorator]:
    """A module's ``pytestmark``: the e2e layer, its time limit (booting engines is slow on
    a small machine), and one event loop for the module, which its stack and ``http`` live on."""
    return [
        pytest.mark.e2e,
        pytest.mark.timeout(timeout_s),
        pytest.mark.asyncio(loop_scope="module"),
    ]


def stack_fixture(**settings: Any) -> Any:
    """The module's ``stack`` fixture: one stack, ``StackConfig(**settings)`` in a fresh work
    directory, started before the module's first test and stopped after its last. Assign it
    to ``stack`` at module level."""

    @pytest_asyncio.fixture(scope="module", loop_scope="module")
    async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
        config = StackConfig(workdir=tmp_path_factory.mktemp("stack"), **settings)
        async with Stack(config) as running:
            yield running

    return stack


def user_message(turn: int, lines: int = 14) -> str:
    """A turn's text: ``lines`` lines of the corpus, different for each ``turn``."""
    return " ".join(LINES[(turn * lines) % len(LINES) :][:lines])
