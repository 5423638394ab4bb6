"""kvbroker's keys in vLLM's ``kv_connector_extra_config``, read once when the connector is
built.

They live apart from the connector so that what can be configured, its defaults and the
reasons for them are in one place that does not need vLLM to read or test; vLLM's own keys
that kvbroker also reads (``kv_recompute_threshold``, ``decoder_kv_blocks_ttl``) keep their
meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KvBrokerSettings:
    """``kv_connector_extra_config`` keys (vLLM's own keys keep their meaning)."""

    # Where the sidecar listens, e.g. "unix:/tmp/kvbroker-decode-0.sock"; empty: no control
    # plane (vLLM's behaviour, except that sessionless requests are not retained).
    sidecar: str = ""
    # vLLM's: reuse only when at least this many remote tokens remain to be read.
    recompute_threshold: int = 64
    # vLLM's hard cap on retention, seconds: no deadline from the lease may exceed it.
    hard_cap_s: float = 480.0
    # How long the prefill side waits for the lease check before recomputing (the request
    # waits; vLLM's scheduler thread does not).
    lease_check_timeout_s: float = 0.25
    # Engine steps that schedule nothing sleep this long while requests wait (for remote KV,
    # a lease check or blocks: steps poll their progress). vLLM spins at ~1 kHz while it
    # retains blocks; on a shared CPU that starves the model threads.
    idle_step_sleep_s: float = 0.005
    # With nothing running or waiting, only retained blocks, a step waits up to this long for
    # a client request instead, and ends the moment one is queued (0: as while waiting).
    # Measured: a decode node holding one retained conversation used 0.38 cores at 5 ms.
    idle_wait_s: float = 0.05
    # NIXL's progress thread poll delay, microseconds (NIXL's Python API forces 0: a spin).
    progress_thread_delay_us: int = 1000
    # Release retained conversations when the engine lacks free blocks (off: vLLM's fixed TTL).
    pressure_release: bool = True
    # The most of the KV cache retention may hold. 1.0 (no budget) by default: with release
    # under pressure, a budget only cost reuse in `kvbroker bench agentic` (66 % at 0.8
    # against 82 % without, no stalls either way); set one to keep room free ahead of need,
    # e.g. for the time the engine cannot reach the registry to release (releases go through
    # it).
    retention_max_fraction: float = 1.0
    # A reclaim the registry has not answered within this long may be asked again (or of
    # another request); meanwhile its blocks count as being freed.
    reclaim_retry_s: float = 1.0
    # A DECODE_LOCAL turn takes the KV of its conversation's unfinished last block from the
    # retained request instead of recomputing it (``engine_ext.retained_tail``); engines the
    # rules do not cover turn it off themselves (``vllm_compat.tail_reuse_unsupported``).
    retained_tail_reuse: bool = True
    # A prefill engine asks the registry for another conversation's retained KV that a long
    # prompt with no handle of its own starts with (a fork, a sub-agent given its parent's
    # history: ``engine_ext.prefix_match``), and reads it without taking it; off: such a
    # prompt is computed whole, as before.
    prefix_match: bool = True

    # A keys file (``TENANT SHA256_HEX`` lines, the router's --api-keys form): the session
    # middleware then resolves a session only for the tenant whose key the request carries
    # (``kvbroker.common.rules.tenants``), and a request without a key as a plain turn. Empty:
    # every session id is taken as given (an engine port only trusted callers reach).
    api_keys: str = ""
    # A session keys file (``TENANT SESSION_KEY_HEX`` lines, ``kvbroker tenant key``; a
    # secret): a signed session id (``kvbroker tenant session-id``) then resolves to its
    # tenant's conversation when its signature verifies, for clients behind a router that
    # forwards no API key (``vllm-router``). With either file set, a session id that neither
    # a key nor a signature vouches for is served as a plain turn.
    session_keys: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> KvBrokerSettings:
        return cls(
            sidecar=str(extra.get("kvbroker_sidecar", "")),
            api_keys=str(extra.get("kvbroker_api_keys", "")),
            session_keys=str(extra.get("kvbroker_session_keys", "")),
            recompute_threshold=int(extra.get("kv_recompute_threshold", cls.recompute_threshold)),
            hard_cap_s=float(extra.get("decoder_kv_blocks_ttl", cls.hard_cap_s)),
            lease_check_timeout_s=float(
                extra.get("kvbroker_lease_check_timeout_s", cls.lease_check_timeout_s)
            ),
            idle_step_sleep_s=float(extra.get("kvbroker_idle_step_sleep_s", cls.idle_step_sleep_s)),
            idle_wait_s=float(extra.get("kvbroker_idle_wait_s", cls.idle_wait_s)),
            progress_thread_delay_us=int(
                extra.get("kvbroker_progress_thread_delay_us", cls.progress_thread_delay_us)
            ),
            pressure_release=_flag(extra.get("kvbroker_pressure_release", cls.pressure_release)),
            retention_max_fraction=float(
                extra.get("kvbroker_retention_max_fraction", cls.retention_max_fraction)
            ),
            reclaim_retry_s=float(extra.get("kvbroker_reclaim_retry_s", cls.reclaim_retry_s)),
            retained_tail_reuse=_flag(
                extra.get("kvbroker_retained_tail_reuse", cls.retained_tail_reuse)
            ),
            prefix_match=_flag(extra.get("kvbroker_prefix_match", cls.prefix_match)),
        )

    def __post_init__(self) -> None:
        if not 0.0 < self.retention_max_fraction <= 1.0:
            raise ValueError(
                "kvbroker_retention_max_fraction must be in (0, 1], "
                f"not {self.retention_max_fraction}"
            )


def _flag(value: object) -> bool:
    """A JSON boolean, or the strings people write for one."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)
