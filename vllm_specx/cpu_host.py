"""What this x86-64 CPU can do for the CPU engine, read once, named one way everywhere.

vLLM's CPU backend runs on four classes of x86-64 host, and the project's choices differ
between them (docs/benchmarks/real-pair.md, "Which CPU"):

* ``AVX2`` -- no native bfloat16: oneDNN cannot pack bfloat16 weights
  (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False) and bfloat16 arithmetic is
  emulated, so engines default to float32 and the packed linear packs float32 only;
* ``AVX-512`` -- AVX-512 without its bfloat16 instructions: oneDNN packs bfloat16 but
  computes it by conversion; float32 stays the default;
* ``AVX512-BF16`` -- native bfloat16 dot products: bfloat16 is the default dtype;
* ``AMX`` -- Intel's tile unit (Sapphire Rapids and later): bfloat16 as above, but
  oneDNN's AMX bfloat16 kernels sum a row differently depending on how many rows share
  the call (measured: SmolLM2's shapes, every product from 1 to 40 rows), and greedy
  speculation -- which verifies K + 1 rows where plain decoding runs one -- must give each
  row the same numbers whatever the count. :func:`cap_onednn_isa_for_exact_rows` keeps
  oneDNN on its AVX512-BF16 kernels there (row-count invariant, and within noise of AMX
  for the 1-9 row products of decoding; benchmarks/cpu_linear_microbench.py).

The class is the EFFECTIVE one: torch's dispatch level (``ATEN_CPU_CAPABILITY``) and
oneDNN's (``ONEDNN_MAX_CPU_ISA``) caps count, so :data:`AVX2_SIMULATION_ENV` (those two and
MKL's ``MKL_ENABLE_INSTRUCTIONS``) makes an AVX-512 host compute, and report itself, as an
AVX2-only one (the test command runs the CPU-sensitive tests that way too). Its timings are
the newer core's running AVX2 code, not an AVX2-only CPU's: say so beside any number.
"""

from __future__ import annotations

import logging
import os
from functools import cache

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger and handlers

AVX2 = "AVX2"
AVX512 = "AVX-512"
AVX512_BF16 = "AVX512-BF16"
AMX = "AMX"
OTHER = "other"
# Most capable first.
CPU_CLASSES = (AMX, AVX512_BF16, AVX512, AVX2, OTHER)

ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"
# An AVX2-only host, simulated on a newer x86 CPU: torch's kernels, oneDNN's and MKL's
# all capped at AVX2 (each read when the process first uses that library).
AVX2_SIMULATION_ENV = {"ATEN_CPU_CAPABILITY": "avx2", ONEDNN_ISA_ENV: "AVX2",
                       "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
# oneDNN's name for "AVX-512 with bfloat16 instructions, no AMX".
ONEDNN_NO_AMX_ISA = "AVX512_CORE_BF16"
# Set to an on value to leave oneDNN's AMX kernels on (rows then depend on their batch).
KEEP_AMX_ENV = "VLLM_SPECX_CPU_KEEP_AMX"


def _torch_cpu_check(name: str) -> bool:
    import torch

    check = getattr(torch.cpu, name, None)
    return bool(check()) if callable(check) else False


def onednn_bf16() -> bool:
    """Whether oneDNN computes (and packs) bfloat16 here, under its ISA cap."""
    import torch

    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:  # a torch built without oneDNN
        return False


def _onednn_cap() -> str:
    return os.environ.get(ONEDNN_ISA_ENV, "").strip().upper()


def cpu_class() -> str:
    """The effective class of this CPU: one of :data:`CPU_CLASSES`."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability().upper()  # honours ATEN_CPU_CAPABILITY
    if not capability.startswith("AVX"):
        return OTHER
    if capability == "AVX2" or not onednn_bf16():
        return AVX2 if capability == "AVX2" else AVX512
    # oneDNN's cap names the ISAs it may use (AVX512_CORE < AVX512_CORE_BF16 < ..._AMX).
    cap = _onednn_cap()
    bf16_allowed = not cap or any(part in cap for part in ("BF16", "AMX", "FP16", "AVX10"))
    amx_allowed = not cap or "AMX" in cap
    if not bf16_allowed or not (_torch_cpu_check("_is_avx512_bf16_supported")
                                or _torch_cpu_check("_is_amx_tile_supported")):
        return AVX512
    if amx_allowed and _torch_cpu_check("_is_amx_tile_supported"):
        return AMX
    return AVX512_BF16


def native_bf16() -> bool:
    """Whether bfloat16 is native here (AVX512-BF16 or AMX, and oneDNN computes it): where a
    bfloat16 decoding step costs about half of float32's."""
    return cpu_class() in (AMX, AVX512_BF16)


def describe(dtype: str | None = None) -> str:
    """One phrase for reports: ``"AVX512-BF16 CPU, bfloat16"``; an AMX host whose oneDNN is
    capped says so (``"AVX512-BF16 CPU (AMX host, oneDNN capped at AVX512_CORE_BF16)"``)."""
    found = cpu_class()
    text = f"{found} CPU"
    if found != AMX and _torch_cpu_check("_is_amx_tile_supported"):
        text += f" (AMX host, oneDNN capped at {_onednn_cap() or 'its default'})"
    return f"{text}, {dtype}" if dtype else text


@cache
def cap_onednn_isa_for_exact_rows() -> bool:
    """On an AMX host, keep oneDNN on its AVX512-BF16 kernels (see the module docstring).

    Sets ``ONEDNN_MAX_CPU_ISA`` unless the user set it or ``VLLM_SPECX_CPU_KEEP_AMX`` is on;
    oneDNN reads it at its first primitive, so this must run before any oneDNN product in
    the process (the plugin's registration does, before a model loads). Returns whether
    the cap was set by this call."""
    from vllm_specx.envflags import env_flag

    if _onednn_cap() or env_flag(KEEP_AMX_ENV) or not _torch_cpu_check("_is_amx_tile_supported"):
        return False
    os.environ[ONEDNN_ISA_ENV] = ONEDNN_NO_AMX_ISA
    logger.info(
        "vllm-specx: AMX CPU: oneDNN kept on its %s kernels (%s=%s), whose results do not "
        "depend on how many rows share a product; %s=1 keeps AMX",
        ONEDNN_NO_AMX_ISA, ONEDNN_ISA_ENV, ONEDNN_NO_AMX_ISA, KEEP_AMX_ENV,
    )
    return True
