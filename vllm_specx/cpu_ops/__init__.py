"""CPU reference backend: vLLM's compiled ``_C`` CPU ops written in PyTorch.

The PyPI vLLM wheel is a CUDA build; its CPU engine needs ops that only vLLM's CPU
build registers. This package registers equivalent PyTorch implementations, but only
when vLLM runs on the CPU platform and no compiled CPU attention op exists.
"""


def register_cpu_reference_ops_if_needed() -> bool:
    """Register the reference ops when (and only when) they are needed.

    Returns True when the ops were registered (now or by an earlier call).
    """
    return False
