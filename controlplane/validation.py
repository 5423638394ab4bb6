"""Bad-input guards every part of the registry applies the same way (limits from the config)."""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.config import RegistryConfig
from controlplane.errors import InvalidArgument
from kvbroker.common import ids
from kvbroker.v1 import lease_pb2


def block_count(handle: lease_pb2.KvHandle) -> int:
    return sum(len(group.block_ids) for group in handle.remote_block_groups)


class Validation:
    def __init__(self, config: RegistryConfig) -> None:
        self._config = config

    def id(self, value: str, what: str) -> str:
        """``value`` if it is a usable id."""
        try:
            return ids.check_id(value, what, self._config.max_id_length)
        except ids.InvalidId as error:
            raise InvalidArgument(str(error)) from None

    def retention(
        self, handle: lease_pb2.KvHandle, block_hashes: Sequence[bytes], token_count: int
    ) -> int:
        """Refuses what no engine could have retained; returns the number of blocks (counted
        once: walking a handle's groups costs microseconds, and a replay has 100k)."""
        self.id(handle.remote_request_id, "handle.remote_request_id")
        limit = self._config.max_block_hashes
        if len(block_hashes) > limit:
            raise InvalidArgument(f"{len(block_hashes)} block hashes exceed the limit of {limit}")
        blocks = block_count(handle)
        if blocks > limit:
            raise InvalidArgument(f"{blocks} block ids exceed the limit of {limit}")
        if token_count == 0:
            raise InvalidArgument("token_count must be positive")
        return blocks
