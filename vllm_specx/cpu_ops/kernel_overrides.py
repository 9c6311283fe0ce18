"""Replacements for two defective Triton-kernel adapters of vLLM's CPU path (0.32, 0.33).

Without Triton, vLLM's CPU platform swaps Triton kernels for Python adapters
(``vllm/utils/cpu_triton_utils.py``) through ``vllm.triton_utils.dispatcher``, which
forwards launch arguments *by name* when the adapter's parameter names equal the
kernel's, else *by position* in the kernel's order. Two adapters break that contract
(details and repro: docs/upstream-vllm-cpu-adapter-defects.md):

* the slot-mapping adapter declares ``block_size`` and ``BLOCKS_PER_KV_BLOCK`` that
  the kernel does not have, so positional forwarding shifts every later argument and
  the first engine step crashes (0.32.0; 0.33.0 fixed the parameter list, but its
  adapter still does not pad ``slot_mapping`` up to ``max_num_tokens`` with ``PAD_ID``
  as the kernel does, so the replacement stays);
* the expand adapter passes int64 *copies* of ``output`` to the op, so float32/int32
  outputs (sampling temperature, top-k, top-p per draft token) are never written.

The replacements below take exactly the kernels' parameter names (so the dispatcher
forwards by name) and write the caller's buffers in place. They are installed by
:func:`install`, which runs before the platform registers its overrides; the platform
then registers these functions under the kernels' names itself.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from vllm_specx.cpu_ops.spec_decode import expand_kernel_impl
from vllm_specx.glue.patch_base import VllmPatch

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger and handlers


def compute_slot_mapping_kernel(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc_ptr: torch.Tensor,
    positions_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    slot_mapping_ptr: torch.Tensor,
    KV_CACHE_BLOCK_SIZE: int,
    TOTAL_CP_WORLD_SIZE: int,
    TOTAL_CP_RANK: int,
    CP_KV_CACHE_INTERLEAVE_SIZE: int,
    PAD_ID: int,
    BLOCK_SIZE: int,
) -> None:
    """``ComputeSlotMappingKernel.kernel``'s semantics, including context-parallel
    interleaving (tokens owned by another rank get ``PAD_ID``) and padding of
    ``slot_mapping[num_tokens:max_num_tokens]`` with ``PAD_ID``."""
    if block_table_ptr.dim() == 2 and block_table_stride != block_table_ptr.stride(0):
        raise ValueError(
            f"block_table_stride={block_table_stride} does not match the block "
            f"table's row stride {block_table_ptr.stride(0)}"
        )
    qsl = query_start_loc_ptr.to(torch.int64)
    counts = qsl[1:] - qsl[:-1]
    first, last = int(qsl[0]), int(qsl[-1])
    if last > first:
        req = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
        pos = positions_ptr[first:last].to(torch.int64)
        virtual_block = KV_CACHE_BLOCK_SIZE * TOTAL_CP_WORLD_SIZE
        vblock = pos // virtual_block
        voff = pos - vblock * virtual_block
        is_local = (voff // CP_KV_CACHE_INTERLEAVE_SIZE) % TOTAL_CP_WORLD_SIZE == TOTAL_CP_RANK
        local_off = (
            voff // (TOTAL_CP_WORLD_SIZE * CP_KV_CACHE_INTERLEAVE_SIZE)
        ) * CP_KV_CACHE_INTERLEAVE_SIZE + voff % CP_KV_CACHE_INTERLEAVE_SIZE
        table = block_table_ptr.reshape(-1, block_table_stride)
        # Non-local tokens are masked below; clamp so their lookup stays in bounds.
        blocks = table[req, vblock.clamp(max=table.shape[1] - 1)].to(torch.int64)
        slots = torch.where(is_local, blocks * KV_CACHE_BLOCK_SIZE + local_off, PAD_ID)
        slot_mapping_ptr[first:last] = slots.to(slot_mapping_ptr.dtype)
    slot_mapping_ptr[num_tokens:max_num_tokens] = PAD_ID


def expand_kernel(
    output_ptr: torch.Tensor,
    input_ptr: torch.Tensor,
    cu_num_tokens_ptr: torch.Tensor,
    replace_from: int,
    replace_to: int,
    MAX_NUM_TOKENS: int,
) -> None:
    """``rejection_sampler.expand_kernel``'s semantics, writing ``output_ptr`` in its
    own dtype (float32 temperatures, int32 top-k, ...)."""
    expand_kernel_impl(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to)


# Triton kernel (qualified name as vLLM's dispatcher spells it) -> (name of vLLM's
# defective adapter in cpu_triton_utils, our replacement).
REPLACEMENTS: dict[str, tuple[str, Callable[..., Any]]] = {
    "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": (
        "_compute_slot_mapping_kernel_impl",
        compute_slot_mapping_kernel,
    ),
    "vllm.v1.sample.rejection_sampler.expand_kernel": (
        "_expand_kernel_impl",
        expand_kernel,
    ),
}


class AdapterDriftError(RuntimeError):
    """vLLM's Triton kernels no longer take the parameters our replacements expect."""


def check_replacement_signatures(expected: dict[str, tuple[str, ...]]) -> None:
    """Fail loudly if a replacement no longer matches the parameter list recorded in
    the drift table (a wrong match would make the dispatcher mis-forward)."""
    for kernel_name, params in expected.items():
        _, impl = REPLACEMENTS[kernel_name]
        ours = tuple(inspect.signature(impl).parameters)
        if ours != params:
            raise AdapterDriftError(
                f"replacement for {kernel_name} takes {ours}, drift table expects {params}"
            )


class CpuAdapterReplacement(VllmPatch):
    """Replace one defective CPU adapter in ``vllm.utils.cpu_triton_utils`` outright.

    The CPU platform registers its adapters (``register_triton_kernel_overrides``)
    after loading general plugins in each worker, reading the adapter functions from
    ``vllm.utils.cpu_triton_utils`` at that moment; swapping the module attribute here
    makes it register ours, once. If the platform has already registered (a plugin
    loaded late), :meth:`after_apply` re-registers through vLLM's ``register_kernels``.
    """

    outright = True  # the dispatcher must see OUR parameter names
    scope = "cpu-reference"

    def __init__(self, kernel_name: str, adapter_attr: str, impl: Callable[..., Any]) -> None:
        self.kernel_name = kernel_name
        self.impl = impl
        self.name = f"cpu_adapter{adapter_attr.removesuffix('_impl')}"
        self.target = f"vllm.utils.cpu_triton_utils:{adapter_attr}"
        self.replaces = f"vLLM's CPU adapter for the Triton kernel {kernel_name}"
        self.why = (
            "its parameters differ from the kernel's, so the dispatcher mis-forwards or the "
            "outputs are never written (docs/upstream-vllm-cpu-adapter-defects.md)"
        )

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return self.impl

    def after_apply(self, module: Any) -> None:
        from vllm.triton_utils import dispatcher

        registered = getattr(dispatcher, "_registry", {}).get(self.kernel_name)
        if registered is not None and registered[1] is not self.impl:
            logger.info("re-registering CPU kernel override after the platform: %s",
                        self.kernel_name)
            dispatcher.register_kernels({self.kernel_name: self.impl})


PATCHES: dict[str, CpuAdapterReplacement] = {
    kernel: CpuAdapterReplacement(kernel, attr, impl)
    for kernel, (attr, impl) in REPLACEMENTS.items()
}


def install(kernel_names: list[str] | tuple[str, ...]) -> list[str]:
    """Apply the adapter replacements for ``kernel_names``; returns the names handled."""
    for kernel_name in kernel_names:
        PATCHES[kernel_name].apply()
    return list(kernel_names)
