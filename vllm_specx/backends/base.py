"""What a device backend declares: its limits and which kernels it runs.

A backend is chosen once, in :func:`vllm_specx.backends.select_backend`, from vLLM's
current platform. Config validation reads the limits from here, so the error a user
sees names the device limit, and the sampler glue calls ``verify`` from here, so the
device-specific kernels live in exactly one module per device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class VerifyFn(Protocol):
    """The verification entry point every backend provides.

    Same contract as :func:`vllm_specx.algorithms.verify.verify`: ragged vLLM layout
    in, ``[B, max_spec_len + 1]`` int64 tokens out (-1 where nothing was emitted).
    """

    def __call__(
        self,
        rule: str,
        draft_token_ids: torch.Tensor,
        cu_num_draft_tokens: torch.Tensor,
        target_probs: torch.Tensor,
        bonus_probs: torch.Tensor,
        is_greedy: torch.Tensor,
        uniforms: torch.Tensor,
        exp_noise: torch.Tensor,
        max_spec_len: int,
        draft_probs: torch.Tensor | None = None,
        draft_token_probs: torch.Tensor | None = None,
        acceptance_threshold: float = 1.0,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class DeviceLimits:
    """Hard limits of a device for speculative decoding.

    ``max_num_speculative_tokens``: largest K the verifier can run (None: no limit of
    its own). On Ascend, ``npu_fused_infer_attention_score`` takes at most 16 query
    tokens per request per decode step, so K + 1 <= 16.

    ``max_beam_positions``: largest ``num_beams * num_speculative_tokens`` for MTAD.
    The beam drafter keeps B candidate tails of length up to K per request in one
    draft batch; this caps that batch so one request cannot blow up the draft step.
    """

    max_num_speculative_tokens: int | None
    max_beam_positions: int
    reason_max_num_speculative_tokens: str = ""
    reason_max_beam_positions: str = ""


@dataclass(frozen=True)
class Backend:
    """One device backend: a name, its limits, and its kernel implementation.

    ``verify`` is the backend's sampler entry point (:class:`VerifyFn`); every shipped
    backend sets it. It is kept optional so a limits-only backend (config validation)
    can still be declared.
    """

    name: str  # "cuda", "npu" or "cpu"
    kernel_impl: str  # e.g. "triton", "torch"
    limits: DeviceLimits
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    verify: VerifyFn | None = None
