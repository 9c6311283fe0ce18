"""Is a compiled ``_C`` op of vLLM registered in this process?

One probe for every question of that kind (the CPU attention's sentinel op, the sgl GEMM's
weight packer), in a leaf module: ``cpu_ops/__init__`` imports ``linear``, so a helper kept
there could not be imported by ``linear`` without an import cycle.
"""

from __future__ import annotations

import torch


def compiled_op_present(name: str) -> bool:
    """True when ``_C::<name>`` has a kernel registered with torch's dispatcher.

    ``torch._C._dispatch_has_kernel`` is private (torch's, not vLLM's; a touch-point); where
    it is missing, ``hasattr(torch.ops._C, name)`` answers instead (it also resolves ops that
    only have a schema, which errs on the side of "compiled build present")."""
    has_kernel = getattr(torch._C, "_dispatch_has_kernel", None)  # private; may go away
    if has_kernel is not None:
        return bool(has_kernel(f"_C::{name}"))
    return hasattr(torch.ops._C, name)
