"""Device backends, chosen in ONE place: :func:`select_backend`.

``cuda``: Triton kernels. ``npu``: pure torch, safe for torch_npu (no Triton).
``cpu``: pure torch. Importing this package never imports torch_npu or Triton.
"""

from __future__ import annotations

import importlib

from vllm_specx.backends.base import Backend, DeviceLimits

__all__ = ["Backend", "DeviceLimits", "select_backend", "backend_for_device", "BACKEND_MODULES"]

# device type (vLLM's ``current_platform.device_type``) -> module defining BACKEND
BACKEND_MODULES: dict[str, str] = {
    "cuda": "vllm_specx.backends.cuda",
    "npu": "vllm_specx.backends.npu",
    "cpu": "vllm_specx.backends.cpu",
}


def backend_for_device(device_type: str) -> Backend:
    """The backend for a device type string ("cuda", "npu", "cpu")."""
    try:
        module_name = BACKEND_MODULES[device_type]
    except KeyError:
        raise ValueError(
            f"vllm-specx has no backend for device type {device_type!r}; "
            f"supported: {', '.join(sorted(BACKEND_MODULES))}"
        ) from None
    return importlib.import_module(module_name).BACKEND


def select_backend() -> Backend:
    """The backend for the platform vLLM is running on (the one place this is decided)."""
    from vllm.platforms import current_platform  # glue-only import, kept lazy

    device_type = current_platform.device_type
    # ROCm reports "cuda" too and runs Triton, so it shares the cuda backend.
    return backend_for_device(device_type)
