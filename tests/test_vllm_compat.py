"""The compat module's version gate: engine_ext loads only into the vLLM series it was written
against, and says which versions are involved when it refuses."""

from __future__ import annotations

import pytest

from kvbroker.engine_ext.vllm_compat import SUPPORTED_VLLM, check_vllm_version


@pytest.mark.parametrize(
    "installed", [SUPPORTED_VLLM, f"{SUPPORTED_VLLM}.0", f"{SUPPORTED_VLLM}.2rc1"]
)
def test_releases_of_the_supported_series_are_accepted(installed: str) -> None:
    check_vllm_version(installed)


@pytest.mark.parametrize("installed", ["0.33.0", "0.31.9", "0.3.2", "0.320.0", "1.0.0"])
def test_other_versions_are_refused_naming_both(installed: str) -> None:
    with pytest.raises(ImportError, match=rf"supports vLLM {SUPPORTED_VLLM}\.x.*vLLM {installed} "):
        check_vllm_version(installed)
