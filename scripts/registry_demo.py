"""`make demo` until the full-stack demo exists: a registry, two simulated nodes, a scripted
three-turn conversation, and the operator CLI showing what the registry knows.

The nodes here are simulated (they speak the sidecar's gRPC calls, no vLLM runs); everything
else is real: the registry process, its gRPC server and the `kvbroker` CLI.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

from kvbroker.common.grpc_client import RegistryEndpoint, open_channel, registry_stub
from kvbroker.v1 import lease_pb2, node_pb2, registry_pb2
from kvbroker.v1.registry_pb2_grpc import RegistryServiceStub

KVBROKER = str(Path(sys.executable).with_name("kvbroker"))


def spec(node_id: str, role: node_pb2.NodeRole, port: int) -> node_pb2.NodeSpec:
    return node_pb2.NodeSpec(
        node_id=node_id,
        role=role,
        engine_id=f"engine-{node_id}",
        side_channel_host="127.0.0.1",
        side_channel_port=port,
        http_base_url=f"http://127.0.0.1:{port + 2400}",
        model="kvbroker-tiny-qwen3",
        block_size=16,
        capacity_blocks=8192,
        bytes_per_block=16 * 28 * 2 * 8 * 128 * 2,
        incarnation=uuid.uuid4().hex[:12],
    )


def cli(address: str, *args: str) -> None:
    command = ["kvbroker", *args, "--registry", address]
    print(f"\n\033[1m$ {shlex.join(command)}\033[0m", flush=True)
    subprocess.run([KVBROKER, *command[1:]], check=False, env={"COLUMNS": "150"})


async def heartbeat(stub: RegistryServiceStub, *nodes: node_pb2.NodeSpec) -> None:
    """What each node's sidecar does: keep the session alive."""
    while True:
        for node in nodes:
            await stub.Heartbeat(
                registry_pb2.HeartbeatRequest(
                    node_id=node.node_id, incarnation=node.incarnation, engine_ready=True
                ),
                timeout=5,
            )
        await asyncio.sleep(1)


def start_registry() -> tuple[subprocess.Popen[str], str]:
    """`kvbroker registry serve` on a free port; returns once it printed its address."""
    registry = subprocess.Popen(
        [KVBROKER, "registry", "serve", "--listen", "127.0.0.1:0", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert registry.stdout is not None
    return registry, json.loads(registry.stdout.readline())["registry"]


async def main() -> None:
    registry, address = await asyncio.to_thread(start_registry)
    try:
        print(f"registry serving on {address}")
        prefill = spec("prefill-0", node_pb2.NODE_ROLE_PREFILL, 5600)
        decode = spec("decode-0", node_pb2.NODE_ROLE_DECODE, 5601)
        async with open_channel(RegistryEndpoint.parse(address)) as channel:
            stub = registry_stub(channel)
            for node in (prefill, decode):
                await stub.RegisterNode(registry_pb2.RegisterNodeRequest(spec=node), timeout=5)
            print("two simulated nodes registered: prefill-0 and decode-0")
            heartbeats = asyncio.create_task(heartbeat(stub, prefill, decode))
            tokens = 0
            for turn in range(1, 4):
                hint = (
                    await stub.GetRoutingHint(
                        registry_pb2.GetRoutingHintRequest(conversation_id="chat-42"), timeout=5
                    )
                ).hint
                decision = registry_pb2.HintDecision.Name(hint.decision)
                print(
                    f"turn {turn}: {decision.removeprefix('HINT_DECISION_')} — {hint.reason}; "
                    f"prefill on {hint.prefill.node_id}, decode on {hint.decode.node_id}"
                )
                tokens += 900
                blocks = -(-tokens // 16)
                # Decode finished the turn and retained its blocks: the sidecar reports them.
                await stub.GrantLease(
                    registry_pb2.GrantLeaseRequest(
                        conversation_id="chat-42",
                        node_id=decode.node_id,
                        node_incarnation=decode.incarnation,
                        handle=lease_pb2.KvHandle(
                            remote_engine_id=decode.engine_id,
                            remote_request_id=f"chatcmpl-turn{turn}",
                            remote_block_groups=[lease_pb2.BlockIdGroup(block_ids=range(blocks))],
                            remote_host=decode.side_channel_host,
                            remote_port=decode.side_channel_port,
                            remote_num_tokens=tokens,
                            tp_size=1,
                        ),
                        block_hashes=[uuid.uuid4().bytes for _ in range(tokens // 16)],
                        token_count=tokens,
                    ),
                    timeout=5,
                )
            for args in (
                ("node", "ls"),
                ("lease", "ls"),
                ("hint", "chat-42"),
                ("lease", "renew", "chat-42", "--conversation", "--ttl", "600"),
                ("lease", "revoke", "chat-42", "--conversation", "--reason", "session closed"),
                ("lease", "ls", "--all"),
                ("hint", "chat-42"),
                ("lease", "show", "no-such-lease"),
            ):
                await asyncio.to_thread(cli, address, *args)
            heartbeats.cancel()
    finally:
        registry.terminate()
        registry.wait(10)
    print("\nregistry stopped")


if __name__ == "__main__":
    asyncio.run(main())
