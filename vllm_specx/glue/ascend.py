"""The hooks of vllm-specx into vLLM-Ascend's NPU model runner (scope ``ascend``).

On Ascend NPUs vLLM runs vLLM-Ascend's own model runner
(``vllm_ascend.worker.model_runner_v1.NPUModelRunner``). It never reaches vLLM's
``GPUModelRunner`` drafter/sampler choice that :mod:`vllm_specx.glue.patches` hooks:

* its ``_set_up_drafter`` asks ``_get_drafter``, which dispatches on the vLLM base
  method (``get_spec_decode_method``), so a specx method would silently get
  vLLM-Ascend's proposer for ``draft_model``/``mtp``; then it builds
  ``AscendRejectionSampler``, so verification would silently be vLLM-Ascend's;
* it drives drafters through vLLM-Ascend's proposer base
  (``vllm_ascend/spec_decode/llm_base_proposer.py``: ``_propose`` with Ascend attention
  metadata and aclgraph), not through vLLM's ``propose``.

Three :class:`VllmPatch` objects (all lazy: applied when vLLM-Ascend imports the module,
so nothing here imports ``vllm_ascend`` or ``torch_npu`` at import time, and they never
apply where vLLM-Ascend is not the platform):

* ``ascend_specx_validation`` -- ``NPUPlatform.check_and_update_config``: refuses, before
  the engine starts and in one line, what cannot run on NPU (a method without an NPU
  drafter, settings the NPU drafter lacks, a draft tree, full-graph capture sizes that
  are not multiples of K + 1, vLLM-Ascend settings that replace verification, 310P,
  runner V2);
* ``ascend_proposer_dispatch`` -- ``NPUModelRunner._get_drafter``: a specx method gets
  the proposer its :class:`~vllm_specx.methods.MethodSpec` names in ``npu_proposer``;
  vLLM-Ascend's own methods reach the original untouched;
* ``ascend_specx_sampler`` -- ``NPUModelRunner._set_up_drafter``: for a specx method the
  ``AscendRejectionSampler`` it builds is replaced by the specx sampler on the ``npu``
  backend, subclassed from ``AscendRejectionSampler`` so vLLM-Ascend's logits processors
  (its Triton-Ascend penalties, bad words, min-tokens, thinking budget) and its
  temperature/top-k/top-p stay in force.

Written against vLLM-Ascend :data:`ASCEND_MIRROR` and checked with the fakes in
``tests/ascend/fakes`` only (no NPU here): docs/ascend.md says what an NPU must confirm.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from typing import Any

from vllm_specx.config import SpecxConfigError, specx_settings
from vllm_specx.glue.patch_base import PatchTargetMissing, VllmPatch
from vllm_specx.methods import METHODS, MethodSpec
from vllm_specx.version_gate import (
    ASCEND_MIRROR,
    ASCEND_MIRROR_COMMIT,
    installed_version,
    vllm_ascend_pair_note,
)

# ASCEND_MIRROR_COMMIT is read from here by tests and docs (the mirror's exact commit).
__all__ = ["ASCEND_MIRROR", "ASCEND_MIRROR_COMMIT", "ASCEND_PATCHES", "apply_if_ascend",
           "build_npu_drafter", "specx_ascend_sampler_class", "validate_on_ascend"]

logger = logging.getLogger("vllm.specx")  # under vLLM's logger: same handlers and format

ASCEND = "ascend"


def ascend_installed() -> bool:
    """vLLM-Ascend is installed (found without importing it)."""
    return importlib.util.find_spec("vllm_ascend") is not None


def runner_is_ascend(runner: Any) -> bool:
    """The runner is vLLM-Ascend's (its own hooks install specx components there)."""
    return any(cls.__module__.startswith("vllm_ascend.") for cls in type(runner).__mro__)


def npu_capable_methods() -> list[str]:
    return [m.name for m in METHODS.values() if m.available and m.npu_proposer is not None]


def npu_method_refusal(spec: MethodSpec, settings: dict[str, Any]) -> str | None:
    """Why ``spec`` with ``settings`` cannot run on vLLM-Ascend's runner, or None."""
    key = f'speculative_config["method"] = "{spec.name}"'
    if not spec.available:
        return f"{key} is not available yet in this version of vllm-specx."
    if spec.npu_proposer is None:
        capable = ", ".join(npu_capable_methods()) or "none yet"
        return (
            f"{key} cannot run on Ascend NPUs yet: its drafter is built on vLLM's GPU "
            "proposer (vllm.v1.spec_decode), while vLLM-Ascend's NPU runner drives drafters "
            "only through its own proposer base (vllm_ascend/spec_decode/llm_base_proposer.py, "
            f"_propose); specx methods that run on NPU: {capable}."
        )
    for refused in spec.npu_refused_settings:
        if settings.get(refused.knob) == refused.value:
            return (
                f'speculative_config["{refused.knob}"] = {str(refused.value).lower()} is not '
                f'allowed with method "{spec.name}" on Ascend NPUs: {refused.why}.'
            )
    return None


def capture_size_refusal(sizes: list[int] | None, num_speculative_tokens: int) -> str | None:
    """Full-graph (aclgraph) capture sizes must be multiples of K + 1 on Ascend.

    One line naming the offending sizes and, for each, the nearest valid size."""
    step = num_speculative_tokens + 1
    bad = [s for s in (sizes or []) if s % step != 0]
    if not bad:
        return None

    def nearest(size: int) -> int:
        below = (size // step) * step
        above = below + step
        return below if below > 0 and size - below <= above - size else above

    pairs = ", ".join(f"{s} -> {nearest(s)}" for s in bad)
    valid = sorted({s if s % step == 0 else nearest(s) for s in sizes or []})
    return (
        f"compilation_config.cudagraph_capture_sizes = {list(sizes or [])} is not allowed "
        f"with a specx method in full-graph (aclgraph) mode on Ascend: every capture size "
        f"must be a multiple of num_speculative_tokens + 1 = {step} (the NPU attention "
        f"verifies K + 1 tokens per request); not multiples (nearest valid): {pairs}; "
        f"e.g. {valid}."
    )


def ascend_setting_refusal(additional_config: dict[str, Any] | None) -> str | None:
    """vLLM-Ascend settings that replace or reshape verification for every method."""
    extra = additional_config or {}
    if extra.get("enable_reduce_sample"):
        return (
            'additional_config["enable_reduce_sample"] = true is not allowed with a specx '
            "method: it keeps the target's logits split over tensor-parallel ranks, and the "
            "specx sampler verifies on full-vocabulary rows; leave it unset or false."
        )
    sampler_config = extra.get("rejection_sampler_config") or {}
    for key in ("enable_block_verify", "enable_entropy_verify"):
        if sampler_config.get(key):
            return (
                f'additional_config["rejection_sampler_config"]["{key}"] = true is not '
                "allowed with a specx method: specx methods verify with the specx sampler "
                "(vLLM-Ascend's block/entropy verification would be ignored); leave it unset."
            )
    return None


def draft_tree_refusal(spec: MethodSpec, settings: dict[str, Any]) -> str | None:
    """A ``draft_tree`` config on NPU: refused in one line with the npu backend's reason
    (the tree mask is not routed into vLLM-Ascend's attention; tree size + 1 <= 16 there)
    and this tree's size, or None without a tree."""
    tree = settings.get("draft_tree")
    if tree in (None, False):
        return None
    from vllm_specx.backends.npu import ASCEND_MAX_QUERY_TOKENS, BACKEND
    from vllm_specx.methods import tree_max_nodes

    nodes = tree_max_nodes(settings)
    size = "" if nodes is None else (
        f" (this tree: up to {nodes} nodes + the root = {nodes + 1} query tokens, "
        f"{'within' if nodes + 1 <= ASCEND_MAX_QUERY_TOKENS else 'over'} that limit)")
    return (f'speculative_config["draft_tree"] = {json.dumps(tree)} is not allowed with method '
            f'"{spec.name}" on Ascend NPUs yet: {BACKEND.limits.reason_no_draft_tree}{size}; '
            "drop draft_tree to verify a chain.")


def validate_on_ascend(vllm_config: Any, settings: dict[str, Any]) -> None:
    """Every Ascend-only refusal, in order; the first raises :class:`SpecxConfigError`."""
    spec = METHODS[settings["method"]]
    refusal = npu_method_refusal(spec, settings)
    if refusal is None:
        refusal = draft_tree_refusal(spec, settings)
    if refusal is None:
        refusal = ascend_setting_refusal(getattr(vllm_config, "additional_config", None))
    if refusal is None and getattr(vllm_config, "use_v2_model_runner", False):
        refusal = (
            f'speculative_config["method"] = "{spec.name}" runs on vLLM-Ascend\'s V1 NPU '
            "runner only (vllm_ascend.worker.model_runner_v1): unset VLLM_USE_V2_MODEL_RUNNER."
        )
    if refusal is None:
        from vllm_ascend.utils import is_310p

        if is_310p():
            refusal = (
                f'speculative_config["method"] = "{spec.name}" is not supported on Ascend 310P: '
                "its runner replaces the rejection sampler after the specx hooks ran."
            )
    if refusal is None and spec.vllm_method == "mtp":
        speculative_config = vllm_config.speculative_config
        if getattr(speculative_config, "use_step3p5_mtp", lambda: False)():
            refusal = (
                f'speculative_config["method"] = "{spec.name}" is not supported on Ascend for '
                "step3p5 MTP layers: vLLM-Ascend drafts them with AscendStep3p5MTPProposer, "
                "which the specx NPU dispatch does not wrap yet."
            )
    if refusal is None and full_graph_decode(vllm_config):
        refusal = capture_size_refusal(
            vllm_config.compilation_config.cudagraph_capture_sizes,
            vllm_config.speculative_config.num_speculative_tokens,
        )
    if refusal is not None:
        raise SpecxConfigError(refusal)
    note = vllm_ascend_pair_note()
    if note is not None:
        logger.warning("%s", note)


def full_graph_decode(vllm_config: Any) -> bool:
    """Decode steps run as full aclgraphs (vLLM-Ascend's FULL / FULL_DECODE_ONLY modes)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "enforce_eager", False):
        return False
    from vllm.config import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode.decode_mode() == CUDAGraphMode.FULL


def is_last_pipeline_stage() -> bool:
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().is_last_rank


def build_npu_drafter(runner: Any, settings: dict[str, Any]) -> Any:
    """The specx proposer for vLLM-Ascend's runner (or one line saying why not)."""
    spec = METHODS[settings["method"]]
    refusal = npu_method_refusal(spec, settings)
    if refusal is None and not is_last_pipeline_stage():
        refusal = (
            f'speculative_config["method"] = "{spec.name}": the drafter must run on the last '
            "pipeline stage (where the target's logits and hidden states are); this rank "
            "is not the last."
        )
    if refusal is not None:
        raise SpecxConfigError(refusal)
    assert spec.npu_proposer is not None
    drafter = spec.npu_proposer()(runner.vllm_config, runner.device, runner)
    drafter.settings = dict(settings)
    return drafter


_sampler_class: type | None = None


def specx_ascend_sampler_class() -> type:
    """The specx sampler as a subclass of vLLM-Ascend's ``AscendRejectionSampler``.

    Method resolution: ``forward`` and the verification are specx's
    (:class:`~vllm_specx.glue.sampler.SpecxRejectionSampler`); ``apply_logits_processors``
    (penalties, bad words, min-tokens, thinking budget) and ``prepare_sampling`` stay
    vLLM-Ascend's; temperature/top-k/top-p are vLLM-Ascend's ``apply_sampling_constraints``.
    Built on first use: vllm_ascend is imported only on an Ascend runner.
    """
    global _sampler_class
    if _sampler_class is not None:
        return _sampler_class
    from vllm_ascend.sample import rejection_sampler as ascend_sampling
    from vllm_ascend.sample.rejection_sampler import AscendRejectionSampler

    from vllm_specx.glue.sampler import SpecxRejectionSampler

    class SpecxAscendRejectionSampler(SpecxRejectionSampler, AscendRejectionSampler):
        """The specx verification rules inside vLLM-Ascend's rejection sampler."""

        def apply_constraints(self, target_logits: Any, metadata: Any,
                              sampling_metadata: Any) -> Any:
            if target_logits.shape[0] == 0:
                return target_logits
            # vLLM-Ascend's returns (logits, indices) for greedy batches and under
            # enable_reduce_sample (refused at start), else the [T, V] logits.
            out = ascend_sampling.apply_sampling_constraints(
                target_logits, metadata.cu_num_draft_tokens, sampling_metadata, self.top_k
            )
            logits, indices = out if isinstance(out, tuple) else (out, None)
            if indices is not None:
                raise RuntimeError(
                    "vllm-specx: vLLM-Ascend returned top-k-compressed logits "
                    "(enable_reduce_sample); the specx sampler needs full-vocabulary rows."
                )
            return logits

    _sampler_class = SpecxAscendRejectionSampler
    return _sampler_class


class _AscendTarget:
    """Mixin for the patches below: the target is vLLM-Ascend's, so a missing target is
    reported against vLLM-Ascend's version and the commit the patch was read against."""

    scope = ASCEND
    lazy = True
    verified_on: tuple[str, ...] = (ASCEND_MIRROR,)

    def _apply_to(self, module: Any) -> None:
        try:
            owner, attr = self._owner_and_attr(module)  # type: ignore[attr-defined]
            present = attr in vars(owner)
        except AttributeError:
            present = False
        if not present:
            raise PatchTargetMissing(
                f"vllm-specx patch {self.name} targets {self.target}, which the installed "  # type: ignore[attr-defined]
                f"vLLM-Ascend {installed_version('vllm_ascend')} does not have (written "
                f"against {ASCEND_MIRROR}; see docs/ascend.md)."
            )
        super()._apply_to(module)  # type: ignore[misc]


class AscendSpecxValidation(_AscendTarget, VllmPatch):
    name = "ascend_specx_validation"
    target = "vllm_ascend.platform:NPUPlatform.check_and_update_config"
    replaces = (
        "NPUPlatform.check_and_update_config (classmethod), which finalises the VllmConfig "
        "for NPU (aclgraph mode and capture sizes, ascend config)"
    )
    why = (
        "after it, the final config is checked for what cannot run on NPU with a specx "
        "method; the refusal is one line before the engine starts, never a crash inside "
        "the NPU runner or a silent fallback to vLLM-Ascend's own proposer or sampler"
    )

    def wrap(self, original: Any) -> Any:
        def check_and_update_config(cls: Any, vllm_config: Any) -> None:
            original(cls, vllm_config)
            settings = specx_settings(vllm_config)
            if settings:
                validate_on_ascend(vllm_config, settings)

        return check_and_update_config


class AscendProposerDispatch(_AscendTarget, VllmPatch):
    name = "ascend_proposer_dispatch"
    target = "vllm_ascend.worker.model_runner_v1:NPUModelRunner._get_drafter"
    replaces = (
        "NPUModelRunner._get_drafter, which returns get_spec_decode_method(<vLLM base "
        "method>, ...): vLLM-Ascend's proposer for draft_model/mtp/eagle/..."
    )
    why = (
        "a specx method must draft with its own NPU proposer (MethodSpec.npu_proposer), "
        "built on vLLM-Ascend's proposer base; vLLM-Ascend's methods reach the original"
    )

    def wrap(self, original: Any) -> Any:
        def get_drafter(self_: Any) -> Any:
            settings = specx_settings(self_.vllm_config)
            if not settings:
                return original(self_)
            drafter = build_npu_drafter(self_, settings)
            logger.info("vllm-specx: %s drafter on NPU: %s", settings["method"],
                        type(drafter).__name__)
            return drafter

        return get_drafter


class AscendSpecxSampler(_AscendTarget, VllmPatch):
    name = "ascend_specx_sampler"
    target = "vllm_ascend.worker.model_runner_v1:NPUModelRunner._set_up_drafter"
    replaces = (
        "NPUModelRunner._set_up_drafter, which builds the drafter (through _get_drafter) "
        "and AscendRejectionSampler on the last pipeline stage"
    )
    why = (
        "for a specx method, verification is the specx rule on the npu backend (one-hot q "
        "residual: p without the drafted token, renormalised), in a subclass of "
        "AscendRejectionSampler that keeps its logits processors and sampling constraints"
    )

    def wrap(self, original: Any) -> Any:
        def set_up_drafter(self_: Any) -> None:
            original(self_)
            settings = specx_settings(self_.vllm_config)
            if not settings or getattr(self_, "drafter", None) is None:
                return
            from vllm_specx.backends import backend_for_device

            backend = backend_for_device("npu")
            self_.rejection_sampler = specx_ascend_sampler_class()(
                self_.sampler, self_.speculative_config, self_.device, settings, backend
            )
            logger.info("vllm-specx: %s sampler rule %r on the %s backend (%s), in "
                        "vLLM-Ascend's runner", settings["method"], self_.rejection_sampler.rule,
                        backend.name, backend.kernel_impl)

        return set_up_drafter


ASCEND_PATCHES: tuple[VllmPatch, ...] = (
    AscendSpecxValidation(),
    AscendProposerDispatch(),
    AscendSpecxSampler(),
)


def apply_if_ascend() -> None:
    """Register the Ascend patches when vLLM-Ascend is installed. Each applies when
    vLLM-Ascend imports its module, i.e. only where vLLM-Ascend is the platform."""
    if not ascend_installed():
        return
    for patch in ASCEND_PATCHES:
        patch.apply()
