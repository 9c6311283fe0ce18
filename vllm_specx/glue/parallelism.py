"""Which of vLLM's parallel layouts a specx method runs under, decided before the engine
starts (docs/scaling-out.md).

Read off vLLM 0.32.0 and tried on its CPU engine (gloo, one machine):

* **Tensor parallel** (``tensor_parallel_size``): runs. The drafter runs on every TP rank
  inside the same TP group as the target, every rank drafts the same tokens. For the
  draft-model methods (``mtad``, ``adaptive``) vLLM's ``DraftModelProposer`` requires
  ``draft_tensor_parallel_size`` equal to ``tensor_parallel_size`` and says so only inside
  the worker, after the engine started: refused here, in one line, before that.
* **Data parallel, dense target**: runs. vLLM makes every DP rank of a dense model an
  independent engine (``EngineCoreProc`` after ``reconfigure_for_independent_dp_rank``:
  ``data_parallel_size`` is 1 inside it), so each rank drafts on its own.
* **Data parallel, MoE target**: refused. vLLM runs the DP ranks of a mixture-of-experts
  model in lockstep (``DPEngineCoreProc``; idle ranks run dummy batches), and every draft
  pass pads its batch across the DP group (``coordinate_batch_across_dp``, an all-reduce
  in ``_determine_batch_execution_and_padding``). specx drafters stop after a different
  number of passes per rank (adaptive stops, MTAD's early stop), so the ranks would wait
  on each other's all-reduce. (On vLLM's CPU engine a MoE target under DP does not start
  at all, with or without speculation: the expert-parallel group's CPU communicator
  imports flashinfer, which needs CUDA.)
* **Pipeline parallel**: refused. vLLM 0.32's V1 model runner, which specx methods use,
  builds the drafter on the last pipeline stage only and its warm-up dummy run then reads
  ``runner.drafter`` on every stage; vLLM's own ``draft_model`` fails at start with
  ``'CPUModelRunner' object has no attribute 'drafter'``.

No vLLM import: the caller passes vLLM's target model config and parallel config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_specx.config import SpecxConfigError

# specx methods whose drafter is vLLM's DraftModelProposer (a separate draft model).
_DRAFT_MODEL_BASE = "draft_model"


def parallelism_refusal(
    method: str,
    vllm_speculative_config: Mapping[str, Any],
    target_model_config: Any,
    target_parallel_config: Any,
) -> SpecxConfigError | None:
    """ONE line naming the setting, its value and what is allowed, or None when specx
    ``method`` (translated to ``vllm_speculative_config``) can run under the target's
    parallel layout. Call before the engine starts."""
    tp = int(getattr(target_parallel_config, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(target_parallel_config, "pipeline_parallel_size", 1) or 1)
    dp = int(getattr(target_parallel_config, "data_parallel_size", 1) or 1)
    if pp > 1:
        return SpecxConfigError(
            f"pipeline_parallel_size = {pp} is not allowed with speculative method "
            f"'{method}': vLLM 0.32's V1 model runner (used by specx methods) builds the "
            "drafter on the last pipeline stage only and fails at start on the others; "
            "use pipeline_parallel_size = 1 (tensor_parallel_size > 1 and data parallel "
            "replicas of a dense model are supported)."
        )
    if dp > 1 and bool(getattr(target_model_config, "is_moe", False)):
        model_type = getattr(getattr(target_model_config, "hf_config", None), "model_type", "?")
        return SpecxConfigError(
            f"data_parallel_size = {dp} is not allowed with speculative method '{method}' "
            f"on a mixture-of-experts target ({model_type}): vLLM runs its data-parallel "
            "ranks in lockstep and every draft pass synchronises them, while specx drafters "
            "stop after a different number of passes per rank; use data_parallel_size = 1 "
            "(tensor_parallel_size > 1 is supported), or a dense target."
        )
    draft_tp = vllm_speculative_config.get("draft_tensor_parallel_size")
    if (vllm_speculative_config.get("method") == _DRAFT_MODEL_BASE and draft_tp is not None
            and draft_tp != tp):
        return SpecxConfigError(
            f'speculative_config["draft_tensor_parallel_size"] = {draft_tp!r} is not allowed '
            f"for method '{method}' with tensor_parallel_size = {tp}: vLLM 0.32's draft-model "
            f"drafter runs the draft at the target's tensor parallel size; use {tp} or leave "
            "it unset."
        )
    return None
