"""What a device backend declares: its limits and which kernels it runs.

A backend is chosen once, in :func:`vllm_specx.backends.select_backend`, from vLLM's
current platform. Config validation reads the limits from here, so the error a user
sees names the device limit, and the sampler glue calls ``verify`` from here, so the
device-specific kernels live in exactly one module per device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_specx.algorithms.verify import VerifyBatch

# The verification entry point every backend provides: one validated batch in
# (:class:`~vllm_specx.algorithms.verify.VerifyBatch`), ``[B, max_spec_len + 1]`` int64
# tokens out (-1 where nothing was emitted). The rules are
# :func:`vllm_specx.algorithms.verify.verify`'s.
VerifyFn = Callable[[VerifyBatch], torch.Tensor]

# A draft tree's KV compaction (issues 37 and 34): ``copy_slots(kv_cache, src, dst)`` moves
# the K and V of slots ``src[i]`` to ``dst[i]`` in ONE layer's cache, in place, in the
# layout of the attention backend a tree config runs on with this device (every source
# read before any destination is written). Both runners' tree steps call it through the
# selected backend, so the device decides the layout in one place.
CopySlotsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

# Exp(1) noise for a sampled request's extra token (the exponential race of
# :mod:`vllm_specx.algorithms.verify`): ``fill_exp_noise(out, generator)`` fills ``out`` (a
# float32 ``[V]`` row or ``[R, V]`` rows) in place, drawing from ``generator`` (None:
# torch's default generator). Both runners' samplers draw through the selected backend.
ExpNoiseFn = Callable[[torch.Tensor, "torch.Generator | None"], None]


def exponential_noise(out: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """torch's ``exponential_`` (vLLM's own draw; one fast kernel on a GPU or an NPU)."""
    out.exponential_(generator=generator)


# vLLM's rejection sampler asserts ``max_spec_len <= MAX_SPEC_LEN``
# (vllm/v1/sample/rejection_sampler.py, 128 in vLLM 0.32) and the specx sampler keeps
# that contract; a test checks this equals the installed vLLM's constant.
SAMPLER_MAX_SPEC_LEN = 128
REASON_SAMPLER_MAX_SPEC_LEN = (
    "vLLM's rejection sampler verifies at most 128 draft tokens per request per step"
)


@dataclass(frozen=True)
class DeviceLimits:
    """Hard limits of a device for speculative decoding.

    ``max_num_speculative_tokens``: largest K the verifier can run (None: no limit of
    its own). On Ascend, ``npu_fused_infer_attention_score`` takes at most 16 query
    tokens per request per decode step, so K + 1 <= 16.

    ``reason_no_draft_tree``: why a ``draft_tree`` config cannot run here yet ("": it
    can; the CPU backend, where vllm-specx's CPU attention takes the ancestor masks).

    ``max_beam_positions``: largest ``num_beams * num_speculative_tokens`` for MTAD.
    The beam drafter keeps B candidate tails of length up to K per request in one
    draft batch; this caps that batch so one request cannot blow up the draft step.
    """

    max_num_speculative_tokens: int | None
    max_beam_positions: int
    reason_max_num_speculative_tokens: str = ""
    reason_max_beam_positions: str = ""
    # Draft trees (issues 37 and 34): why this device cannot verify a draft tree yet
    # ("" = it can). Config validation and the Ascend check put it in their one-line
    # refusal, so the line names this device's own reason, written in one place.
    reason_no_draft_tree: str = ""
    # Draft trees that run on vLLM's V1 runner here but not on Model Runner V2 yet: why
    # ("" = no such limit; no backend sets it since trees run on V2 on CUDA too, issue
    # 34). A tree config then runs on V1 (vLLM is told so through the V2 opt-out list,
    # and VLLM_USE_V2_MODEL_RUNNER=1 is refused in one line).
    reason_no_draft_tree_v2: str = ""

    def speculative_tokens_limit(self) -> tuple[int, str]:
        """The largest K the whole runtime accepts (the device's own limit or the
        sampler's, whichever is tighter) and why: the one place config validation reads
        it from, so no runtime assertion can trip on a config that passed validation."""
        device_k = self.max_num_speculative_tokens
        if device_k is not None and device_k < SAMPLER_MAX_SPEC_LEN:
            return device_k, self.reason_max_num_speculative_tokens
        return SAMPLER_MAX_SPEC_LEN, REASON_SAMPLER_MAX_SPEC_LEN


@dataclass(frozen=True)
class Backend:
    """One device backend: a name, its limits, its verification kernel, its draft tree KV
    move and how it draws the verification's Exp(1) noise."""

    name: str  # "cuda", "npu" or "cpu"
    kernel_impl: str  # e.g. "triton", "torch"
    limits: DeviceLimits
    verify: VerifyFn
    copy_slots: CopySlotsFn
    description: str = ""
    # The clock cost control times the engine's steps with (glue/cost_model.py). Wall
    # time where the device runs the work (a GPU: the host waits for it); on a CPU the
    # process's CPU time, so that other jobs on the host do not read as the cost of
    # this engine's drafts (the work is done in this process's threads either way).
    cost_clock: Callable[[], float] = time.perf_counter
    fill_exp_noise: ExpNoiseFn = exponential_noise
