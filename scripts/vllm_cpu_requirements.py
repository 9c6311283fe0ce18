"""Print the installed vLLM's own requirements minus the packages only a CUDA GPU uses.

``scripts/setup_env.sh`` installs vLLM with ``--no-deps`` on a host without an NVIDIA GPU
and then installs what this prints. vLLM's PyPI wheel is a CUDA build: resolved normally it
pulls about 2.5 GB of CUDA-only packages (FlashInfer, CUTLASS DSL, TileLang, cuDNN, NCCL,
CUDA video and audio builds of torchvision/torchaudio/torchcodec) that its CPU engine never
imports, and whose download and unpacking was most of a fresh clone's set-up time. The CUDA
builds of torchvision/torchaudio/torchcodec also break ``import vllm`` beside a CPU torch.

Run by the venv's Python after ``pip install --no-deps vllm==...``; one requirement per line.
"""

from __future__ import annotations

import importlib.metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What vLLM 0.32's CPU engine never imports (checked: the whole test suite runs without
# them). torch is left out because setup_env.sh pins the CPU build itself.
CUDA_ONLY = frozenset(canonicalize_name(name) for name in (
    "torch", "torchaudio", "torchvision", "torchcodec", "PyNvVideoCodec",
    "flashinfer-python", "tilelang", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl",
    "quack-kernels", "tokenspeed-mla", "humming-kernels",
))


def cpu_requirements(dist: str = "vllm") -> list[str]:
    """``dist``'s unconditional requirements for this interpreter, minus CUDA_ONLY."""
    kept = []
    for line in importlib.metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or one for another platform
        if canonicalize_name(req.name) in CUDA_ONLY:
            continue
        req.marker = None
        kept.append(str(req))
    return kept


if __name__ == "__main__":
    print("\n".join(cpu_requirements()))
