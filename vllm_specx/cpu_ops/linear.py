"""A faster linear layer for vLLM's CPU engine without its compiled ops: oneDNN, prepacked.

vLLM's CPU platform picks each unquantized linear layer's GEMM once, after loading
(``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``): zentorch, its
compiled sgl/oneDNN kernels, else ``torch.nn.functional.linear``. Without the compiled
``_C`` ops (the PyPI wheel on a CPU host, where :mod:`vllm_specx.cpu_ops` registers its
reference ops) every layer gets the ``F.linear`` fallback, which on an AVX-512 CPU runs
a decoding forward's few-row products far below the machine's speed (SmolLM2-135M's
121 GEMMs, one torch thread: bfloat16 32 ms for 1 row, 35-39 ms for 3-6 rows;
float32 45 / 83 / 100 ms for 1 / 2 / 3 rows; benchmarks/cpu_linear_microbench.py).

torch ships oneDNN's linear with a weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight`` + ``torch.ops.mkldnn._linear_pointwise``,
what torch.compile's CPU backend uses): bfloat16 20 ms for 1 row and 17-18 ms for 3-6
rows; float32 38 / 45 / 32 ms. The patch below gives that linear to every 2-D
unquantized layer whose dtype oneDNN packs here, keeps vLLM's choice otherwise, and
drops the original weight when vLLM would (``remove_weight``), as vLLM's own oneDNN path
does. Calls of fewer than :data:`MIN_ROWS` rows are zero-padded to it, so that a row's
result does not depend on how many rows share the call (greedy speculation must match
plain decoding bit for bit). bfloat16 results from 4 rows up are bit-identical to
``F.linear`` (torch's bfloat16 ``F.linear`` is oneDNN's, unpacked); float32 ones differ
in the last bits (another summation order), like any change of BLAS kernel.
``VLLM_SPECX_CPU_PLAIN_LINEAR=1`` keeps vLLM's own choice (read when the model loads;
for comparisons).

Per CPU class (:mod:`vllm_specx.cpu_host`): float32 is packed everywhere; bfloat16 only
where oneDNN computes it (:func:`onednn_packs`: not on an AVX2-only CPU, where bfloat16
layers keep vLLM's linear and engines default to float32 anyway). On an AMX CPU oneDNN's
AMX kernels would make a row's result depend on the row count at every size, so the
plugin caps oneDNN at its AVX512-BF16 kernels there
(:func:`vllm_specx.cpu_host.cap_onednn_isa_for_exact_rows`); and vLLM's own choice for
small bfloat16 weights on AMX (its sgl kernel, packed by a compiled op the PyPI wheel
lacks) is replaced by its ``F.linear`` fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from vllm_specx.envflags import env_flag
from vllm_specx.glue.patch_base import VllmPatch

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger and handlers

# The dtypes the patch packs (oneDNN packs float16 only on CPUs with AVX-NE-CONVERT or
# AVX512-FP16; vLLM's F.linear fallback is kept for it and every other dtype).
PACKED_DTYPES = (torch.bfloat16, torch.float32)
# Products get at least this many rows (zero-padded; one row is no cheaper than four):
# below 4 rows oneDNN picks another kernel, whose summation order differs for some shapes
# (SmolLM2's down projection, 1536 inputs), so a row's result would depend on how many
# rows share the call -- and greedy speculation, which verifies K + 1 rows where plain
# decoding runs one, would drift from plain decoding in bfloat16. From 4 rows up (checked
# for 1-64 rows on SmolLM2's shapes) each row's result is the same whatever the count.
MIN_ROWS = 4
# Set to an on value to keep vLLM's own linear (the F.linear fallback), e.g. to measure.
PLAIN_LINEAR_ENV = "VLLM_SPECX_CPU_PLAIN_LINEAR"


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` on this CPU: float32 everywhere, bfloat16 only where
    oneDNN computes bfloat16 (AVX-512 and up; not on an AVX2-only CPU, whose engines
    default to float32: :func:`vllm_specx.cpu_host.cpu_class`)."""
    from vllm_specx import cpu_host

    if dtype == torch.bfloat16:
        return cpu_host.onednn_bf16()
    return dtype in PACKED_DTYPES


def packed_linear(weight: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """A ``cpu_linear(x, weight, bias)`` on ``weight`` prepacked for oneDNN, or None when
    this torch/CPU cannot pack it (the caller keeps its own linear then)."""
    if (weight.dtype not in PACKED_DTYPES or weight.ndim != 2 or weight.device.type != "cpu"
            or not onednn_packs(weight.dtype)):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (RuntimeError, AttributeError) as exc:  # no oneDNN, or no kernel for the dtype
        logger.debug("oneDNN prepacking unavailable for %s: %s", weight.dtype, exc)
        return None
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def cpu_linear(
        x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        # ``weight`` is the layer's (possibly emptied) parameter, unused: vLLM's
        # ``cpu_unquantized_gemm`` passes it to every backend.
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or rows >= MIN_ROWS:
            return linear_pointwise(x, packed, bias, "none", [], "")
        flat = x.reshape(rows, x.shape[-1])
        flat = torch.cat((flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])))
        out = linear_pointwise(flat, packed, bias, "none", [], "")[:rows]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return cpu_linear


class OneDnnPackedLinear(VllmPatch):
    """``dispatch_cpu_unquantized_gemm`` wrapped: 2-D weights of a packed dtype get the
    oneDNN prepacked linear; everything else goes to vLLM's own choice."""

    name = "cpu_onednn_packed_linear"
    target = "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm"
    replaces = (
        "vLLM's CPU GEMM choice for unquantized 2-D linear layers (its torch.nn.functional"
        ".linear fallback when the compiled _C ops are missing)"
    )
    why = (
        "oneDNN's linear on a weight prepacked once is 1.6-2x faster than F.linear for the "
        "few-row products of decoding and verification (bfloat16, bit-identical); "
        "benchmarks/cpu_linear_microbench.py"
    )
    scope = "cpu-reference"

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
            weight = getattr(layer, "weight", None)
            if (weight is None or weight.is_meta or env_flag(PLAIN_LINEAR_ENV)
                    or _zentorch_platform()):
                return _vllms_choice(original, layer, remove_weight)
            linear = packed_linear(weight)
            if linear is None:
                return _vllms_choice(original, layer, remove_weight)
            layer.cpu_linear = linear
            if remove_weight:
                layer.weight = torch.nn.Parameter(
                    torch.empty(0, dtype=weight.dtype, device=weight.device),
                    requires_grad=False,
                )
            return None

        return dispatch_cpu_unquantized_gemm


def _vllms_choice(
    original: Callable[..., Any], layer: torch.nn.Module, remove_weight: bool
) -> None:
    """vLLM's own GEMM choice, except the one it cannot run here: on an AMX CPU vLLM gives
    small bfloat16 weights its sgl kernel, packed by the compiled
    ``_C.convert_weight_packed`` that the PyPI wheel lacks (the layer's load would die);
    those keep vLLM's own last resort, ``F.linear``."""
    weight = getattr(layer, "weight", None)
    if weight is not None and not weight.is_meta and weight.ndim == 2 and _sgl_kernel_missing(
            weight.shape[0], weight.shape[1], weight.dtype):
        layer.cpu_linear = _f_linear
        return None
    return original(layer, remove_weight)


def _f_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _sgl_kernel_missing(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    from vllm_specx.cpu_ops.compiled_ops import compiled_op_present

    return (not compiled_op_present("convert_weight_packed", schema_counts=False)
            and check_cpu_sgl_kernel(out_features, in_features, dtype))


def _zentorch_platform() -> bool:
    """vLLM's zentorch path (AMD's own kernels) is left to vLLM."""
    from vllm.platforms import current_platform

    is_zen = getattr(current_platform, "is_zen_cpu", None)
    return bool(callable(is_zen) and is_zen() and hasattr(torch.ops, "zentorch")
                and hasattr(torch.ops.zentorch, "zentorch_linear_unary"))


PATCHES: dict[str, OneDnnPackedLinear] = {OneDnnPackedLinear.name: OneDnnPackedLinear()}


def install(names: tuple[str, ...] | list[str]) -> list[str]:
    """Apply the linear patches ``names`` (from the drift table); returns them."""
    for name in names:
        PATCHES[name].apply()
    return list(names)
