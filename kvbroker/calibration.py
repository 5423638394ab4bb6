"""Measuring a node's costs for the planner (``kvbroker calibrate``).

Prefill: a few probe prompts of different lengths, each fresh (a random opening, so no prefix
cache can serve it), sent straight to the node's engine with ``max_tokens=1``; the time to
answer is the time to compute the prompt. A least-squares fit of

    t(n) = fixed + n * per_token + n² / 2 * per_token_context

(the last term is attention: token i attends to the i before it) gives the three prefill
figures of a ``CostProfile``. The token counts are the engine's own (``usage.prompt_tokens``).

Reads: from the node's own NIXL telemetry (``vllm:nixl_xfer_time_seconds`` and
``vllm:nixl_bytes_transferred``), the mean time per block it has read so far; a node that has
never read keeps the planner's defaults for reads.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from kvbroker.common.rules.costs import DEFAULT_COSTS, Costs
from kvbroker.common.rules.engine_metrics import blocks, read_totals

PROBE_TOKENS = (64, 512, 2048)
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]


@dataclass(frozen=True, slots=True)
class Probe:
    tokens: int
    seconds: float


def fit_prefill(probes: Sequence[Probe]) -> tuple[float, float, float]:
    """(fixed ms, µs per token, ns per token and context token): the least-squares fit of
    t = a + b n + c n²/2 with every coefficient at least zero (a cost cannot be negative; with
    noisy probes an unconstrained fit can make one so). Every subset of the three terms is
    fitted and the best fit whose coefficients are all non-negative kept."""
    if len({p.tokens for p in probes}) < 3:
        raise ValueError("probes of at least three different lengths are needed")
    rows = [(1.0, float(p.tokens), p.tokens * p.tokens / 2.0) for p in probes]
    ys = [p.seconds for p in probes]
    best: tuple[float, list[float]] | None = None
    for terms in itertools.chain.from_iterable(
        itertools.combinations(range(3), k) for k in (3, 2, 1)
    ):
        solution = _least_squares([[r[t] for t in terms] for r in rows], ys)
        if solution is None or min(solution) < 0:
            continue
        full = [0.0, 0.0, 0.0]
        for term, value in zip(terms, solution, strict=True):
            full[term] = value
        residual = sum(
            (y - sum(f * x for f, x in zip(full, row, strict=True))) ** 2
            for row, y in zip(rows, ys, strict=True)
        )
        if best is None or residual < best[0]:
            best = (residual, full)
    if best is None:
        raise ValueError("the probes fit no non-negative costs")
    a, b, c = best[1]
    return a * 1e3, b * 1e6, c * 1e9


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """The least-squares solution (normal equations, Gaussian elimination); None when
    singular. At most three unknowns: no numerical library for that."""
    n = len(rows[0])
    matrix = [
        [sum(r[i] * r[j] for r in rows) for j in range(n)]
        + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
        for i in range(n)
    ]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(matrix[r][col]))
        if abs(matrix[pivot][col]) < 1e-18:
            return None
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        for r in range(n):
            if r != col:
                factor = matrix[r][col] / matrix[col][col]
                matrix[r] = [a - factor * b for a, b in zip(matrix[r], matrix[col], strict=True)]
    return [matrix[i][n] / matrix[i][i] for i in range(n)]


def read_cost_us_per_block(metrics_text: str, bytes_per_block: int) -> float | None:
    """Mean NIXL read time per block the node has read, or None if it has read nothing."""
    totals = read_totals(metrics_text)
    if totals is None or totals.read_seconds <= 0:
        return None
    read = blocks(totals.read_bytes, bytes_per_block)
    return totals.read_seconds * 1e6 / read if read > 0 else None


def fresh_prompt(tokens: int, rng: random.Random) -> str:
    """About ``tokens`` tokens of made-up words, different every time (no cache hits)."""
    return " ".join(
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(tokens)
    )


async def probe_prefill(
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    sizes: Sequence[int] = PROBE_TOKENS,
    repeats: int = 3,
    seed: int | None = None,
) -> list[Probe]:
    """The fastest of ``repeats`` answers for each size (scheduling noise only adds time)."""
    rng = random.Random(seed)
    probes = []
    for size in sizes:
        best: Probe | None = None
        for _ in range(repeats):
            body = {
                "model": model,
                "prompt": fresh_prompt(size // 2, rng),  # about two tokens a word
                "max_tokens": 1,
                "temperature": 0,
            }
            started = time.perf_counter()
            response = await http.post(f"{base_url}/v1/completions", json=body)
            elapsed = time.perf_counter() - started
            response.raise_for_status()
            tokens = int(response.json()["usage"]["prompt_tokens"])
            if best is None or elapsed < best.seconds:
                best = Probe(tokens, elapsed)
        assert best is not None
        probes.append(best)
    return probes


def measured_costs(
    probes: Sequence[Probe], read_us_per_block: float | None, default: Costs = DEFAULT_COSTS
) -> Costs:
    fixed, per_token, per_context = fit_prefill(probes)
    return Costs(
        prefill_fixed_ms=fixed,
        prefill_us_per_token=per_token,
        prefill_ns_per_token_context=per_context,
        read_fixed_ms=default.read_fixed_ms,
        read_us_per_block=(
            read_us_per_block if read_us_per_block is not None else default.read_us_per_block
        ),
        # A measured per-block figure is the reads' whole time, their runs included.
        read_us_per_run=0.0 if read_us_per_block is not None else default.read_us_per_run,
    )
