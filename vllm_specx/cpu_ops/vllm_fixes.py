"""Small runtime fixes for vLLM's CPU kernel-override machinery (no-Triton path).

Both concern ``vllm.triton_utils.dispatcher.register_kernels``, which the CPU platform
calls from every worker's ``init_worker``. After swapping a kernel it scans every
module in ``sys.modules`` for other references to the original kernel, reading
``vars(value).get("kernel")`` of every attribute that has a ``__dict__``.

Each fix is a named :class:`~vllm_specx.glue.patch_base.VllmPatch` (what it replaces, why,
verified vLLM range), applied only for the releases whose drift-table entry lists it.

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

import logging
import sys
import types
from collections.abc import Callable
from typing import Any

from vllm_specx.glue.patch_base import VllmPatch

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger and handlers


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


class TolerantKernelRebind(VllmPatch):
    name = "cpu_tolerant_kernel_rebind"
    scope = "cpu-reference"
    target = "vllm.triton_utils.dispatcher:_rebind_kernels"
    replaces = "dispatcher._rebind_kernels, the sys.modules scan after a kernel override"
    why = (
        "the scan crashes once numba/llvmlite is imported (their objects answer __dict__ "
        "with a non-mapping); vLLM's scan still runs first, ours only if it raises "
        "(docs/upstream-vllm-cpu-adapter-defects.md, defect 3)"
    )

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def rebind(overrides: list[tuple[Any, Any]]) -> None:
            try:
                original(overrides)
            except (AttributeError, TypeError) as exc:
                logger.debug("vLLM kernel rebind scan failed (%s); using the tolerant scan", exc)
                _tolerant_rebind(overrides)

        return rebind


class OverrideRegistrationOnce(VllmPatch):
    name = "cpu_override_registration_once"
    scope = "cpu-reference"
    target = "vllm.platforms.cpu:CpuPlatform.register_triton_kernel_overrides"
    replaces = "CpuPlatform.register_triton_kernel_overrides (a classmethod run per worker)"
    why = (
        "the overrides are process-global; a second engine in one process would redo the "
        "sys.modules scan and log an overwrite per kernel"
    )

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        done = False

        def register_once(cls: type) -> None:
            nonlocal done
            if done:
                return
            original(cls)
            done = True

        return register_once


# Names used by the drift table (``ReleaseTable.runtime_fixes``) -> patch.
FIXES: dict[str, VllmPatch] = {
    "tolerant_kernel_rebind": TolerantKernelRebind(),
    "register_overrides_once": OverrideRegistrationOnce(),
}


def apply(names: tuple[str, ...]) -> None:
    for name in names:
        FIXES[name].apply()
