"""What every specx proposer offers the runner hook and the bench, and what none supports.

:class:`SpecxProposer` is the contract (a ``typing.Protocol``): the runner hook checks a
freshly built drafter against it, and the bench reads a drafter's counters through it,
instead of probing attributes with ``getattr``. :func:`refuse_unsupported_options` is the
one place a specx drafter refuses vLLM options it cannot run with.

No vLLM or torch import at module level: the bench imports this in its own process.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class SpecxProposer(Protocol):
    """A specx drafter as the runner hook, the runner and the bench use it.

    * built like vLLM's V1 proposers, ``Class(vllm_config, device, runner)``; the runner
      hook then sets ``settings`` (the method's validated settings) before ``load_model``;
    * ``propose(...)`` takes vLLM's V1 ``propose`` arguments and returns the drafts:
      ``[R, K]`` token ids, or one list per request when the drafts are ragged;
    * ``take_last_draft_probs()`` hands the sampler the last round's draft probabilities
      (the ``q`` of the verification rule), or None when ``q`` is one-hot (argmax drafts);
    * ``specx_stats()`` returns the drafter's own counters (``vllm-specx bench`` reads
      the keys of ``bench.metrics.DrafterStats``).
    """

    settings: dict[str, Any]

    def load_model(self, *args: Any, **kwargs: Any) -> None: ...

    def propose(self, num_speculative_tokens: int, *args: Any,
                **kwargs: Any) -> list[list[int]] | torch.Tensor: ...

    def take_last_draft_probs(self) -> torch.Tensor | None: ...

    def specx_stats(self) -> dict[str, Any]: ...


def refuse_unsupported_options(
    proposer: Any, vllm_config: Any, drafting: str, extra_reasons: Iterable[str] = ()
) -> None:
    """Raise ``NotImplementedError`` naming every vLLM option the drafter cannot run with.

    ``drafting`` names the drafter in the message (e.g. "adaptive drafting");
    ``extra_reasons`` are the drafter's own, listed after the ones no specx drafter
    supports: parallel drafting (all positions in one pass, where specx drafters feed
    token by token) and M-RoPE models. Parallel layouts are decided before the engine
    starts (``glue/parallelism.py``): a drafter never sees ``data_parallel_size > 1``
    (vLLM runs each DP rank of a dense target as its own engine with DP = 1; a MoE
    target under DP is refused there).
    """
    reasons = []
    if proposer.parallel_drafting:
        reasons.append("parallel drafting drafts all positions in one pass")
    if proposer.uses_mrope:
        reasons.append("M-RoPE models")
    reasons.extend(extra_reasons)
    if reasons:
        raise NotImplementedError(
            f"vllm-specx {drafting} does not support: " + "; ".join(reasons)
        )
