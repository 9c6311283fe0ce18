"""Runner hook: swap in the specx drafter and sampler on a freshly built V1 runner."""

from __future__ import annotations

from typing import Any

from vllm_specx.config import SpecxConfigError
from vllm_specx.methods import METHODS


def install_specx_components(runner: Any, settings: dict[str, Any]) -> None:
    """Replace ``runner.drafter`` and ``runner.rejection_sampler`` for a specx method."""
    method = settings["method"]
    spec = METHODS.get(method)
    if spec is None or not spec.available:
        raise SpecxConfigError(
            f'speculative_config["method"] = "{method}" is not available yet in this version '
            "of vllm-specx."
        )
    raise NotImplementedError(method)
