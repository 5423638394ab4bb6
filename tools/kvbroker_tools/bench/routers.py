"""The multi-turn benchmark behind routers other than kvbroker's (``--router``): the same
conversations through ``vllm-router`` (the real one, from the package index) or vLLM's
example P/D proxy (``kvbroker_tools.harness.pd_proxies``), over the same engines, with reuse on (a
session id; the engines resolve their own handles) and off (none).

Each router adds two arms, interleaved with kvbroker's at every point like any arm:
``vllm-router`` / ``vllm-router-off`` and ``proxy`` / ``proxy-off``. The targets: behind
another router, a follow-up's TTFT within 15 % of the same turn on the same path behind
kvbroker's router, and reuse never slower than reuse off behind the same router. Both routers
always run a prefill leg, so their reuse takes the READ path (with one decode node, the turn
always reaches the node holding the KV): the like-for-like arm is kvbroker's ``read``, and the
ratio to kvbroker's ``planner`` (which may take DECODE_LOCAL, a path these routers never
take) is shown beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbroker_tools.bench.stats import ratio
from kvbroker_tools.harness.pd_proxies import running_proxy
from kvbroker_tools.harness.vllm_router import running_vllm_router
from kvbroker_tools.stack import Stack

# Each router other than kvbroker's, and its arms with reuse on and off.
ROUTER_ARMS = {"vllm-router": ("vllm-router", "vllm-router-off"), "proxy": ("proxy", "proxy-off")}
ROUTERS = ("kvbroker", *ROUTER_ARMS)
FOREIGN_ARMS = tuple(arm for pair in ROUTER_ARMS.values() for arm in pair)
WITHIN_KVBROKER = 1.15


def router_of(arm: str) -> str:
    return next((router for router, pair in ROUTER_ARMS.items() if arm in pair), "kvbroker")


def sends_session(arm: str) -> bool:
    """Whether the arm's turns carry a session id (reuse on)."""
    return arm != "off" and not arm.endswith("-off")


def arms_of(routers: Sequence[str], kvbroker_arms: Sequence[str]) -> tuple[str, ...]:
    """The arms a run measures: ``kvbroker_arms`` if kvbroker's router is among ``routers``,
    and both arms of each other router."""
    unknown = [router for router in routers if router not in ROUTERS]
    if not routers or unknown:
        raise ValueError(f"routers {list(routers)}: choose from {', '.join(ROUTERS)}")
    arms = list(kvbroker_arms) if "kvbroker" in routers else []
    for router in routers:
        arms += ROUTER_ARMS.get(router, ())
    return tuple(arms)


@contextlib.asynccontextmanager
async def router_urls(
    stack: Stack, arms: Sequence[str], workdir: Path
) -> AsyncIterator[dict[str, str]]:
    """Each arm's base URL, with the other routers it needs started over the stack's engines
    for the duration of the block."""
    prefills, decodes = [stack.url(stack.prefill)], [stack.url(e) for e in stack.decodes]
    urls = {"kvbroker": stack.router_url}
    async with contextlib.AsyncExitStack() as started:
        needed = {router_of(arm) for arm in arms}
        if "vllm-router" in needed:
            urls["vllm-router"] = await started.enter_async_context(
                running_vllm_router(prefills, decodes, workdir / "vllm-router.log")
            )
        if "proxy" in needed:
            urls["proxy"], _ = await started.enter_async_context(
                running_proxy("toy", prefills, decodes)
            )
        yield {arm: urls[router_of(arm)] for arm in arms}


def router_rows(median: Mapping[str, float]) -> dict[str, Any]:
    """At one point: each other router's reuse arm against kvbroker's on the same path (its
    ``read`` arm), against kvbroker's planner, and against its own reuse-off arm (None where
    an arm did not run)."""
    row: dict[str, Any] = {}
    for on, off in ROUTER_ARMS.values():
        row[f"{on}_vs_read"] = ratio(median.get(on), median.get("read"))
        row[f"{on}_vs_planner"] = ratio(median.get(on), median.get("planner"))
        row[f"{on}_vs_off"] = ratio(median.get(on), median.get(off))
    return row


def router_targets(row: Mapping[str, Any]) -> dict[str, bool | None]:
    verdicts: dict[str, bool | None] = {}
    for on, _ in ROUTER_ARMS.values():
        vs_kvbroker, vs_off = row[f"{on}_vs_read"], row[f"{on}_vs_off"]
        if vs_kvbroker is not None:
            verdicts[f"{on}_within_kvbroker"] = vs_kvbroker <= WITHIN_KVBROKER
        if vs_off is not None:
            verdicts[f"{on}_not_slower_than_off"] = vs_off <= 1.0
    return verdicts


def router_comparisons(row: Mapping[str, Any], arm: str) -> list[tuple[str, bool | None]]:
    """The ratios judged on ``arm``'s line of the table: a router's reuse-off arm carries its
    reuse arm's ratio to it, kvbroker's read arm each router's ratio to it (the target), and
    kvbroker's planner each router's ratio to it (shown, not judged)."""
    verdicts, found = row["targets"], []
    for on, off in ROUTER_ARMS.values():
        if arm == off and row[f"{on}_vs_off"] is not None:
            found.append(
                (f"{on}/off {row[f'{on}_vs_off']:.2f}x", verdicts[f"{on}_not_slower_than_off"])
            )
        if arm == "read" and row[f"{on}_vs_read"] is not None:
            found.append(
                (
                    f"{on}/kvbroker-read {row[f'{on}_vs_read']:.2f}x",
                    verdicts[f"{on}_within_kvbroker"],
                )
            )
        if arm == "planner" and row[f"{on}_vs_planner"] is not None:
            found.append((f"{on}/kvbroker {row[f'{on}_vs_planner']:.2f}x", None))
    return found
