"""vLLM plugin entry point (group ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts (API server, engine core,
each worker), sometimes more than once. It must be idempotent, cheap, and must not
initialise CUDA: it checks the vLLM version, applies the patches of scope ``always``
(the runner patch waits until vLLM imports the runner), registers the ``ascend``
patches where vLLM-Ascend is installed (they wait for vLLM-Ascend's modules) and, on a
CPU host without vLLM's compiled CPU ops, registers the PyTorch reference ops (the
``cpu-reference`` patches).
Every patch is listed in :mod:`vllm_specx.glue.touchpoints`.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_registered = False


def register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        from vllm_specx.cpu_ops import register_cpu_reference_ops_if_needed
        from vllm_specx.glue.ascend import apply_if_ascend
        from vllm_specx.glue.patches import apply_all
        from vllm_specx.version_gate import check_vllm_version

        check_vllm_version()
        apply_all()
        apply_if_ascend()  # vLLM-Ascend's runner: applied when vLLM-Ascend imports it
        register_cpu_reference_ops_if_needed()
        _registered = True
