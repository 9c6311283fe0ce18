"""Small runtime fixes for vLLM's CPU kernel-override machinery (no-Triton path).

Both concern ``vllm.triton_utils.dispatcher.register_kernels``, which the CPU platform
calls from every worker's ``init_worker``. After swapping a kernel it scans every
module in ``sys.modules`` for other references to the original kernel, reading
``vars(value).get("kernel")`` of every attribute that has a ``__dict__``.

* ``tolerant_kernel_rebind``: some objects answer ``__dict__`` with something that is
  not a mapping (llvmlite's ``_lib_wrapper`` returns a function wrapper for any
  attribute), so once numba/llvmlite is imported -- vLLM's n-gram proposer imports it
  -- the scan raises ``AttributeError`` and engine start-up fails. That happens for
  an engine started in a process that already ran an n-gram engine, or imported numba
  for any reason (in-process engines, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). We run
  vLLM's scan unchanged and only if it raises redo it while skipping such objects.
* ``register_overrides_once``: the overrides are process-global (module attributes),
  so registering them again for a second engine in the same process only repeats
  the scan and logs "already registered. Overwriting." for each kernel; we make the
  platform's registration run once per process.

See docs/upstream-vllm-cpu-adapter-defects.md (defect 3).
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def _tolerant_rebind(overrides: list[tuple[Any, Any]]) -> None:
    """Point every reference to each original kernel at its wrapper, skipping objects
    whose ``__dict__`` is not a real mapping (same targets as vLLM's scan)."""
    wrappers = [(orig, wrapper) for orig, wrapper in overrides]

    def wrapper_for(value: Any) -> Any:
        for orig, wrapper in wrappers:
            if value is orig:  # identity only: some values misbehave on == / hash
                return wrapper
        return None

    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            found = wrapper_for(value)
            if found is not None:
                setattr(module, attr, found)
                continue
            try:
                inner = vars(value)
            except TypeError:
                continue
            if not isinstance(inner, (dict, types.MappingProxyType)):
                continue
            found = wrapper_for(inner.get("kernel"))
            if found is None:
                continue
            value.kernel = found
            if not isinstance(value, type):
                value.__dict__.pop("_kernel_arg_names", None)


def install_tolerant_kernel_rebind() -> None:
    """Wrap ``dispatcher._rebind_kernels``: vLLM's own scan first, ours if it fails."""
    from vllm.triton_utils import dispatcher

    original: Callable[..., Any] = dispatcher._rebind_kernels
    if getattr(original, "_vllm_specx_tolerant", False):
        return

    @functools.wraps(original)
    def rebind(overrides: list[tuple[Any, Any]]) -> None:
        try:
            original(overrides)
        except (AttributeError, TypeError) as exc:
            logger.debug("vLLM kernel rebind scan failed (%s); using the tolerant scan", exc)
            _tolerant_rebind(overrides)

    rebind._vllm_specx_tolerant = True  # type: ignore[attr-defined]
    dispatcher._rebind_kernels = rebind


def make_override_registration_once() -> None:
    """Let the CPU platform register its Triton kernel overrides once per process."""
    from vllm.platforms.cpu import CpuPlatform

    current = CpuPlatform.__dict__["register_triton_kernel_overrides"]
    func = current.__func__ if isinstance(current, classmethod) else current
    if getattr(func, "_vllm_specx_once", False):
        return
    done = False

    @functools.wraps(func)
    def register_once(cls: type) -> None:
        nonlocal done
        if done:
            return
        func(cls)
        done = True

    register_once._vllm_specx_once = True  # type: ignore[attr-defined]
    CpuPlatform.register_triton_kernel_overrides = classmethod(register_once)  # type: ignore[method-assign]


FIXES: dict[str, Callable[[], None]] = {
    "tolerant_kernel_rebind": install_tolerant_kernel_rebind,
    "register_overrides_once": make_override_registration_once,
}


def apply(names: tuple[str, ...]) -> None:
    for name in names:
        FIXES[name]()
