"""The vLLM surface kvbroker relies on (``engine_ext.vllm_surface``), checked on the installed
vLLM: an upgrade that moves a private field, renames a hook's parameter or drops a
``kv_transfer_params`` key fails here. ``make compat`` runs it against every supported release."""

from __future__ import annotations

import pytest

from kvbroker.engine_ext import vllm_surface
from kvbroker.engine_ext.vllm_compat import VLLM_SERIES
from kvbroker.engine_ext.vllm_surface import SURFACE, Kind, Name


@pytest.mark.parametrize(
    "name", [n for n in SURFACE if vllm_surface.applies(n, VLLM_SERIES)], ids=str
)
def test_every_name_relied_on_exists_with_its_shape(name: Name) -> None:
    assert vllm_surface.problem(name) is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (Name("vllm.v1.request", "Request.no_such_field", Kind.INSTANCE), "no instance attribute"),
        (Name("vllm.v1.request", "NoSuchClass.field", Kind.INSTANCE), "'NoSuchClass' is missing"),
        (
            Name("vllm.v1.core.block_pool", "BlockPool.get_cached_block", Kind.CALLABLE, ("hash",)),
            "parameters",
        ),
        (Name("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "no_such_key", Kind.KEY), "key"),
        (Name("vllm.v1.request", "state.no_such_field", Kind.ASSIGNED), "not assigned"),
        (Name("vllm.no_such_module", "x"), "cannot be imported"),
    ],
    ids=str,
)
def test_a_moved_name_is_reported(name: Name, expected: str) -> None:
    found = vllm_surface.problem(name)
    assert found is not None and expected in found


def test_names_a_later_release_added_apply_from_it_on() -> None:
    later = Name("vllm", "x", since="0.33")
    assert not vllm_surface.applies(later, "0.32")
    assert vllm_surface.applies(later, "0.33") and vllm_surface.applies(later, "0.34")
