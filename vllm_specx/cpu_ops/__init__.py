"""CPU reference backend: vLLM's compiled ``_C`` CPU ops written in PyTorch.

The PyPI vLLM wheel is a CUDA build; its CPU engine needs ops that only vLLM's CPU
build registers. This package registers equivalent PyTorch implementations, but only
when vLLM runs on the CPU platform and no compiled CPU attention op exists. See
docs/cpu-reference-backend.md.

* this module -- the decision to register, and the registration;
* :mod:`.attention`, :mod:`.mla`, :mod:`.rotary`, :mod:`.sampling`, :mod:`.spec_decode` -- the ops;
* :mod:`.schemas` -- the drift table: per vLLM release, the ops and their schemas;
  :mod:`.drift` -- the checks that refuse a vLLM the table does not describe;
* :mod:`.kernel_overrides`, :mod:`.vllm_fixes`, :mod:`.linear` -- the patches of vLLM's
  CPU path (listed
  with every other patch in :mod:`vllm_specx.glue.touchpoints`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger and handlers

_lock = threading.Lock()
_library: Any = None  # the torch.library.Library; kept alive or the ops vanish
_registered_release: str | None = None

# The op that only a compiled vLLM CPU build provides; its presence means "real build".
SENTINEL_OP = "cpu_attention_with_kv_cache"


@dataclass(frozen=True)
class Decision:
    register: bool
    reason: str


def decide(device_type: str | None, compiled_cpu_attention_present: bool) -> Decision:
    """Pure decision: register the reference ops or not."""
    if device_type != "cpu":
        return Decision(False, f"vLLM platform is {device_type or 'unspecified'!r}, not CPU")
    if compiled_cpu_attention_present:
        return Decision(False, f"a compiled torch.ops._C.{SENTINEL_OP} already exists")
    return Decision(True, "CPU platform without vLLM's compiled CPU ops")


def _current_device_type() -> str | None:
    # Resolving vLLM's platform queries drivers (e.g. NVML) but initialises no device.
    from vllm.platforms import current_platform

    return getattr(current_platform, "device_type", None)


def _load_compiled_kernels() -> None:
    """Let vLLM import its compiled kernels first (what ``vllm._custom_ops`` does on
    import), so a real CPU build is seen before we decide; a failed import only logs."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()


def _compiled_cpu_attention_present() -> bool:
    from vllm_specx.cpu_ops.compiled_ops import compiled_op_present

    return compiled_op_present(SENTINEL_OP, schema_counts=True)


def implementations() -> dict[str, Callable[..., Any]]:
    """Op name -> PyTorch implementation (every op the drift table may list)."""
    from vllm_specx.cpu_ops import attention, mla, rotary, sampling, spec_decode

    def init_cpu_memory_env(node_ids: list[int]) -> None:
        # The compiled op binds allocations to NUMA nodes; nothing to do in PyTorch.
        return None

    return {
        "init_cpu_memory_env": init_cpu_memory_env,
        "cpu_attn_has_isa": attention.cpu_attn_has_isa,
        "rotary_embedding": rotary.rotary_embedding,
        "get_scheduler_metadata": attention.get_scheduler_metadata,
        "cpu_attn_reshape_and_cache": attention.cpu_attn_reshape_and_cache,
        "cpu_attention_with_kv_cache": attention.cpu_attention_with_kv_cache,
        "mla_decode_kvcache": mla.mla_decode_kvcache,
        "compute_slot_mapping_kernel_impl": spec_decode.compute_slot_mapping_kernel_impl,
        "greedy_argmax": sampling.greedy_argmax,
        "fused_gumbel_argmax": sampling.fused_gumbel_argmax,
        "rejection_greedy_sample_kernel_impl": spec_decode.rejection_greedy_sample_kernel_impl,
        "rejection_random_sample_kernel_impl": spec_decode.rejection_random_sample_kernel_impl,
        "expand_kernel_impl": spec_decode.expand_kernel_impl,
        "sample_recovered_tokens_kernel_impl": spec_decode.sample_recovered_tokens_kernel_impl,
        "eagle_prepare_inputs_padded_kernel_impl": (
            spec_decode.eagle_prepare_inputs_padded_kernel_impl
        ),
        "eagle_prepare_next_token_padded_kernel_impl": (
            spec_decode.eagle_prepare_next_token_padded_kernel_impl
        ),
        "eagle_step_slot_mapping_metadata_kernel_impl": (
            spec_decode.eagle_step_slot_mapping_metadata_kernel_impl
        ),
        "copy_and_expand_eagle_inputs_kernel_impl": (
            spec_decode.copy_and_expand_eagle_inputs_kernel_impl
        ),
    }


def _define_ops(ops: dict[str, str]) -> Any:
    import torch

    impls = implementations()
    unknown = sorted(set(ops) - set(impls))
    if unknown:
        from vllm_specx.cpu_ops.drift import CpuOpsDriftError

        raise CpuOpsDriftError(f"drift table lists ops without an implementation: {unknown}")
    # FRAGMENT: adds to the ``_C`` namespace without claiming it (``DEF`` would clash
    # with any other fragment). CompositeExplicitAutograd serves CPU tensors and ops
    # with no tensor arguments alike.
    lib = torch.library.Library("_C", "FRAGMENT")
    for name, schema in ops.items():
        lib.define(schema)
        lib.impl(name, impls[name], "CompositeExplicitAutograd")
    return lib


def registered_release() -> str | None:
    """The drift-table entry (a vLLM release) whose ops were registered, or None if not
    registered. Equals the installed release unless the drift bypass made an unknown
    release borrow the newest table."""
    return _registered_release


def register_cpu_reference_ops_if_needed() -> bool:
    """Register the reference ops when (and only when) they are needed.

    Returns True when the ops were registered (now or by an earlier call). Cheap and
    side-effect free off the CPU platform; raises
    :class:`~vllm_specx.cpu_ops.drift.CpuOpsDriftError` rather than register ops for a
    vLLM release the drift table does not know.
    """
    global _library, _registered_release
    with _lock:
        if _library is not None:
            return True
        device_type = _current_device_type()
        if device_type != "cpu":  # decided before touching any kernels
            logger.debug("CPU reference ops not needed: %s", decide(device_type, False).reason)
            return False
        _load_compiled_kernels()
        decision = decide(device_type, _compiled_cpu_attention_present())
        if not decision.register:
            logger.debug("CPU reference ops not needed: %s", decision.reason)
            return False

        from vllm_specx.cpu_host import cap_onednn_isa_for_exact_rows
        from vllm_specx.cpu_ops import drift, kernel_overrides, linear, vllm_fixes

        # Before any model loads: oneDNN reads its ISA cap at its first product.
        cap_onednn_isa_for_exact_rows()

        version = drift.installed_vllm_version()
        table_key = drift.select_release_key(version)
        release = drift.RELEASES[table_key]
        drift.verify_vllm_call_sites(release, version)
        kernel_overrides.check_replacement_signatures(release.defective_adapters)
        _library = _define_ops(release.ops)
        vllm_fixes.apply(release.runtime_fixes)
        kernel_overrides.install(tuple(release.defective_adapters))
        linear.install(release.linear_patches)
        drift.install_namespace_guard(version, list(release.ops))
        _registered_release = table_key
        logger.info(
            "vllm-specx: registered %d PyTorch reference ops for vLLM %s's CPU engine "
            "(drift table of vLLM %s)",
            len(release.ops),
            version,
            table_key,
        )
        return True
