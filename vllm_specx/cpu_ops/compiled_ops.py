"""Is a compiled ``_C`` op of vLLM registered in this process?

One probe for every question of that kind (the CPU attention's sentinel op, the sgl GEMM's
weight packer), in a leaf module: ``cpu_ops/__init__`` imports ``linear``, so a helper kept
there could not be imported by ``linear`` without an import cycle.
"""

from __future__ import annotations

import torch


def compiled_op_present(name: str, *, schema_counts: bool) -> bool:
    """True when ``_C::<name>`` has a kernel registered with torch's dispatcher.

    ``torch._C._dispatch_has_kernel`` is private (torch's, not vLLM's; a touch-point).
    ``schema_counts``: also answer True when ``torch.ops._C`` merely resolves the name (a
    schema without a kernel here); the attention decision takes that as "a compiled build
    is present" and leaves the ops to vLLM, the GEMM decision needs a kernel it can call."""
    has_kernel = getattr(torch._C, "_dispatch_has_kernel", None)  # private; may go away
    if has_kernel is not None and has_kernel(f"_C::{name}"):
        return True
    return schema_counts and hasattr(torch.ops._C, name)
