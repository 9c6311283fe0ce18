"""VllmConfig stand-ins with the fields vLLM-Ascend's runner and platform read."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

SPECX_MTP = {"method": "specx_mtp", "adaptive": False}
MTAD = {"method": "mtad", "num_beams": 2, "acceptance_threshold": 0.1}
ADAPTIVE = {"method": "adaptive", "min_speculative_tokens": 1, "stop_threshold": 0.7}


def make_config(method: str, k: int = 2, specx: dict[str, Any] | None = None,
                additional: dict[str, Any] | None = None, cudagraph_mode: Any = None,
                capture_sizes: list[int] | None = None, enforce_eager: bool = False,
                step3p5: bool = False, v2: bool = False) -> SimpleNamespace:
    from vllm.config import CUDAGraphMode

    speculative = SimpleNamespace(
        method=method, num_speculative_tokens=k, rejection_sample_method="strict",
        synthetic_acceptance_rates=None, use_step3p5_mtp=lambda: step3p5,
        use_dspark=lambda: method == "dspark",
    )
    extra = dict(additional or {})
    if specx is not None:
        extra["specx"] = dict(specx)
    return SimpleNamespace(
        speculative_config=speculative,
        additional_config=extra,
        compilation_config=SimpleNamespace(
            cudagraph_mode=cudagraph_mode if cudagraph_mode is not None
            else CUDAGraphMode.PIECEWISE,
            cudagraph_capture_sizes=capture_sizes,
        ),
        model_config=SimpleNamespace(enforce_eager=enforce_eager),
        use_v2_model_runner=v2,
    )
