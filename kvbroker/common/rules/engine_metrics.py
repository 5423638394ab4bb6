"""What a vLLM engine's /metrics says about the work it has done: running totals of its
prefills and of its NIXL reads, and the work between two readings. ``kvbroker calibrate`` reads
a node's read cost off the totals; the sidecar sends the work of each probe interval with its
heartbeats, and the registry compares its time with what the node's costs predict
(``controlplane/sessions/cost_correction.py``).

Prefills come from vLLM's per-request histograms, all observed together when a request
finishes: ``vllm:request_prefill_time_seconds`` (from being scheduled to the first token, so a
request that waited for KV read from elsewhere counts from when the KV was there),
``vllm:request_prefill_kv_computed_tokens`` (prompt tokens less those cached, locally or read
in) and ``vllm:request_prompt_tokens``. Being observed at the same moment, their differences
between two readings cover the same requests; the iteration counters (``vllm:prompt_tokens``,
``vllm:prefix_cache_hits``) count at other moments and would not. Reads come from the NIXL
connector's per-transfer histograms: ``vllm:nixl_xfer_time_seconds`` and
``vllm:nixl_bytes_transferred``, on the node that reads.

Beside the totals, ``read_gauges`` reads an engine's gauges as they stand (``kvbroker bench
agentic`` samples the decode engine's KV cache usage and waiting requests with it). The
sidecar's load figures are not read here: ``sidecar/engine_load.py`` checks each of them for
what a heartbeat can carry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvbroker.v1 import node_pb2

# Totals are counts of requests, tokens, bytes and seconds: any beyond this (where floats stop
# counting in ones) is saturated, so every difference fits the proto's uint64.
_MAX_TOTAL = float(2**53)
# Sample name -> the Totals field it adds to. Several series (one per engine or model name)
# add up.
_TOTALS = {
    "vllm:request_prefill_time_seconds_count": "prefills",
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
    "vllm:request_prefill_kv_computed_tokens_sum": "computed_tokens",
    "vllm:request_prompt_tokens_sum": "prompt_tokens",
    "vllm:nixl_xfer_time_seconds_count": "reads",
    "vllm:nixl_xfer_time_seconds_sum": "read_seconds",
    "vllm:nixl_bytes_transferred_sum": "read_bytes",
}


@dataclass(frozen=True, slots=True)
class Totals:
    """The engine's running totals since it started (what one /metrics answer says)."""

    prefills: float = 0.0
    prefill_seconds: float = 0.0
    computed_tokens: float = 0.0
    prompt_tokens: float = 0.0
    reads: float = 0.0
    read_seconds: float = 0.0
    read_bytes: float = 0.0


class TotalsReader:
    """Adds up the samples of one /metrics answer that make its ``Totals``. A total that is
    not finite or is negative is no total: the answer's totals are then unusable, and
    ``ignored`` says why."""

    def __init__(self) -> None:
        self._sums = dict.fromkeys(_TOTALS.values(), 0.0)
        self.ignored: list[str] = []

    def add(self, sample: Sample) -> bool:
        """Takes ``sample`` if it is one of the totals; False if it is not."""
        field = _TOTALS.get(sample.name)
        if field is None:
            return False
        if not (math.isfinite(sample.value) and sample.value >= 0):
            self.ignored.append(f"{sample.name} = {sample.value!r} is not a total")
        else:
            self._sums[field] = min(self._sums[field] + sample.value, _MAX_TOTAL)
        return True

    def totals(self) -> Totals | None:
        """The answer's totals; None if any of them was unusable."""
        return None if self.ignored else Totals(**self._sums)


def read_totals(text: str) -> Totals | None:
    """The totals in one /metrics answer (None if any was unusable); raises the parser's
    errors when the answer is not Prometheus text."""
    reader = TotalsReader()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            reader.add(sample)
    return reader.totals()


def read_gauges(text: str, gauges: Mapping[str, str]) -> dict[str, float]:
    """Each of ``gauges`` (key -> metric name) in one /metrics answer, by key: the sum of its
    samples (a series per engine or model name), 0 where it has none. Values are taken as the
    engine gives them, unchecked; raises the parser's errors when the answer is not Prometheus
    text."""
    keys = {name: key for key, name in gauges.items()}
    values = dict.fromkeys(gauges, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in keys:
                values[keys[sample.name]] += sample.value
    return values


def blocks(read_bytes: float, bytes_per_block: int) -> float:
    """KV blocks in ``read_bytes`` on a node of ``bytes_per_block`` (0 when unknown)."""
    return read_bytes / bytes_per_block if bytes_per_block > 0 else 0.0


def work_between(before: Totals, after: Totals, bytes_per_block: int) -> node_pb2.EngineWork:
    """The work done between two readings of the same engine (``after`` no earlier). Parts
    with no requests or no transfers are left at zero."""
    work = node_pb2.EngineWork()
    prefills = round(after.prefills - before.prefills)
    if prefills > 0:
        computed = after.computed_tokens - before.computed_tokens
        prompt = after.prompt_tokens - before.prompt_tokens
        work.prefills = prefills
        work.prefill_computed_tokens = round(computed)
        work.prefill_cached_tokens = max(round(prompt - computed), 0)
        work.prefill_seconds = after.prefill_seconds - before.prefill_seconds
    reads = round(after.reads - before.reads)
    if reads > 0:
        work.reads = reads
        work.read_blocks = blocks(after.read_bytes - before.read_bytes, bytes_per_block)
        work.read_seconds = after.read_seconds - before.read_seconds
    return work


def went_back(before: Totals, after: Totals) -> bool:
    """Some total is lower than before: the engine restarted (its counters began again)."""
    return any(getattr(after, f.name) < getattr(before, f.name) for f in fields(Totals))


def add_work(into: node_pb2.EngineWork, work: node_pb2.EngineWork) -> None:
    """Adds ``work`` to ``into`` (the work of several intervals, reported once)."""
    for field, value in work.ListFields():
        setattr(into, field.name, min(getattr(into, field.name) + value, int(_MAX_TOTAL)))


class WorkMeter:
    """Turns successive readings of one engine into the work done between them, held until
    it is reported (``take``). The first reading, and one after the totals went back (an
    engine restart), sets the baseline and counts no work; an unusable reading is skipped, so
    the next usable one counts the work of both intervals."""

    def __init__(self) -> None:
        self._baseline: Totals | None = None
        self._pending = node_pb2.EngineWork()

    def observe(self, totals: Totals | None, bytes_per_block: int) -> None:
        if totals is None:
            return
        before, self._baseline = self._baseline, totals
        if before is None or went_back(before, totals):
            return
        add_work(self._pending, work_between(before, totals, bytes_per_block))

    def take(self) -> node_pb2.EngineWork | None:
        """The work held since the last take, or None if there was none."""
        work = self._pending
        if not (work.prefills or work.reads):
            return None
        self._pending = node_pb2.EngineWork()
        return work
