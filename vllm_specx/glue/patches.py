"""The plugin's seams in vLLM, one named :class:`VllmPatch` each (scope ``always``).

Every vLLM touch-point of the package, these and the CPU backend's, is listed in
:mod:`vllm_specx.glue.touchpoints`, with the upgrade checklist.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, get_args

from vllm_specx.config import (
    SPECX_CONFIG_KEY,
    SpecxConfigError,
    refusal_error,
    resolve_method,
    speculative_config_dict,
    specx_settings,
    translate,
)
from vllm_specx.envflags import env_flag
from vllm_specx.glue.beam_kv import BeamScratchReservation
from vllm_specx.glue.cuda_tree_attention import TritonTreeRoute, prepare_cuda_tree_engine
from vllm_specx.glue.parallelism import parallelism_refusal
from vllm_specx.glue.patch_base import VllmPatch
from vllm_specx.glue.tree_step import TREE_STEP_PATCHES
from vllm_specx.glue.v2_patches import V2_PATCHES
from vllm_specx.glue.v2_tree_step import V2_TREE_STEP_PATCHES
from vllm_specx.methods import METHODS, drafts_ragged, tree_on

logger = logging.getLogger("vllm.specx")  # under vLLM's logger: same handlers and format

__all__ = ["ALL_PATCHES", "apply_all", "require_eagle_head_fits_target", "require_mtp_layers",
           "specx_settings", "vllm_method_names", "vllm_speculative_fields"]


def vllm_method_names() -> list[str]:
    """Every method name vLLM's SpeculativeConfig accepts (flattened Literal)."""
    from vllm.config.speculative import SpeculativeMethod

    names: list[str] = []

    def walk(tp: Any) -> None:
        for arg in get_args(tp):
            if isinstance(arg, str):
                names.append(arg)
            else:
                walk(arg)

    walk(SpeculativeMethod)
    return sorted(set(names))


def vllm_speculative_fields() -> set[str]:
    from vllm.config.speculative import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


def require_mtp_layers(target_model_config: Any, settings: dict[str, Any] | None = None,
                       draft_model: str | None = None) -> None:
    """Refuse ``specx_mtp`` for a target without multi-token-prediction layers, in one line;
    and an ``acceptance_head`` that does not fit the MTP layer's hidden state (the
    target's hidden size: there is no draft model to check it against earlier).

    Asks vLLM's own MTP config mapping (``SpeculativeConfig.hf_config_override``, on a
    copy): a target it gives MTP layers (``n_predict``) can draft; any other cannot, and
    vLLM itself would fail later, inside the engine, with an unrelated message.
    """
    head = (settings or {}).get("acceptance_head")
    if head:
        from vllm_specx.acceptance_head_files import acceptance_head_problem

        target_hidden = getattr(target_model_config.hf_config, "hidden_size", None)
        problem = acceptance_head_problem(
            head, draft_model=None, hidden_size=target_hidden, whose="the MTP layer's"
        )
        if problem is not None:
            raise refusal_error("acceptance_head", head, problem, "specx_mtp")
    import copy

    from vllm.config.speculative import SpeculativeConfig

    hf_config = copy.deepcopy(target_model_config.hf_config)
    try:
        n_predict = getattr(SpeculativeConfig.hf_config_override(hf_config), "n_predict", None)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        n_predict = None  # a config vLLM cannot map to an MTP drafter has no MTP layers
    if n_predict:
        return
    model_type = getattr(target_model_config.hf_config, "model_type", "?")
    raise SpecxConfigError(
        f'speculative_config["method"] = "specx_mtp" is not allowed for model '
        f"'{target_model_config.model}' (model_type '{model_type}'): it needs a target with "
        "multi-token-prediction layers (config.json num_nextn_predict_layers >= 1, as in "
        "DeepSeek-V3 or MiMo); for a target without them use 'adaptive' with a draft model."
    )


def eagle_head_problem(head_config: dict[str, Any], base_method: str,
                       target_model_config: Any) -> str | None:
    """Why an EAGLE / EAGLE-3 head's ``config.json`` does not fit the target, or None.

    vLLM's own ``eagle3`` checks none of this: ``fc`` over auxiliary hidden states of
    another width fails inside the engine (on CPU a oneDNN "could not create a primitive
    descriptor" error), auxiliary layers the target does not have leave ``fc`` short of
    inputs, and a head for another vocabulary runs, drafting another tokenizer's ids."""
    target = target_model_config.hf_config
    target_hidden = getattr(target, "hidden_size", None)
    target_vocab = target_model_config.get_vocab_size()
    key = "target_hidden_size" if base_method == "eagle3" else "hidden_size"
    head_hidden = head_config.get(key, head_config.get("hidden_size"))
    if target_hidden is not None and head_hidden != target_hidden:
        return (f"the head's {key} {head_hidden} does not fit the target's hidden size "
                f"{target_hidden}; use a head trained for this target")
    vocab = head_config.get("vocab_size")
    if vocab != target_vocab:
        return (f"the head's vocab_size {vocab} does not fit the target's vocabulary of "
                f"{target_vocab} tokens; use a head trained for this target")
    if base_method != "eagle3":
        return None
    draft_vocab = head_config.get("draft_vocab_size") or vocab
    if not 1 <= draft_vocab <= target_vocab:
        return (f"the head's draft_vocab_size {draft_vocab} must be between 1 and the "
                f"target's vocabulary of {target_vocab} tokens")
    eagle_config = head_config.get("eagle_config") or {}
    layer_ids = (head_config.get("eagle_aux_hidden_state_layer_ids")
                 or eagle_config.get("eagle_aux_hidden_state_layer_ids") or [])
    n_layers = target_model_config.get_total_num_hidden_layers()
    outside = [i for i in layer_ids if not 0 <= i < n_layers]
    if outside:
        return (f"the head reads auxiliary hidden states of layers {list(layer_ids)}, but the "
                f"target has layers 0..{n_layers - 1}")
    return None


def require_eagle_head_fits_target(target_model_config: Any, settings: dict[str, Any],
                                   draft_model: str | None = None) -> None:
    """Refuse, in one line before the engine starts, an EAGLE / EAGLE-3 head (a local
    directory) whose hidden size, vocabulary or auxiliary layers do not fit the target.
    A hub id is left to vLLM, which fetches it later."""
    import json
    from pathlib import Path

    if not draft_model or not (Path(draft_model).expanduser() / "config.json").is_file():
        return
    method = settings["method"]
    head_config = json.loads((Path(draft_model).expanduser() / "config.json").read_text())
    problem = eagle_head_problem(head_config, METHODS[method].vllm_method, target_model_config)
    if problem is not None:
        raise refusal_error("model", draft_model, problem, method)


# What each MethodSpec.v2_cudagraph value means, as logged before the engine starts.
V2_CUDAGRAPH_DECLARATION: dict[str, str] = {
    "captured": "at a fixed K drafting by vLLM's own V2 speculator, which takes part in "
    "V2's CUDA-graph capture; with adaptive: true the specx round after vLLM's first "
    "draft pass runs eager (its batch shrinks within a round); the specx sampler runs "
    "outside graphs, as V2's sampler does",
    "eager": "the specx speculator captures no CUDA graph (its draft batch changes shape "
    "within a round) and runs eager in every capture mode; V2 captures the target model "
    "as usual; the specx sampler runs outside graphs, as V2's sampler does",
}


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def device_v1_only_reason(settings: Any, backend: Any = None) -> str | None:
    """Why these settings need the V1 runner on this device (None: nothing device-specific):
    a draft tree where the device backend verifies trees on V1 only
    (``DeviceLimits.reason_no_draft_tree_v2``: CUDA)."""
    if not settings or not tree_on(settings):
        return None
    if backend is None:
        from vllm_specx.backends import select_backend

        backend = select_backend()
    return backend.limits.reason_no_draft_tree_v2 or None


def _vllm_has_triton() -> bool:
    """vLLM's own answer (decided once, at import) to whether Triton runs here."""
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def runner_choice(v1_reason: str | None) -> tuple[bool, str]:
    """The model runner a specx config will run on, as vLLM chooses it
    (``VllmConfig.use_v2_model_runner``), and why: ``(True, why)`` for Model Runner V2.
    ``VLLM_USE_V2_MODEL_RUNNER`` when set, else V1 for a method or setting that runs on V1
    only (this plugin adds it to vLLM's V2 opt-out list) or without Triton (the CPU
    wheel), else V2 unless vLLM finds another feature V2 lacks (vLLM then logs which, and
    the runner's own line, ``runner_hook.install_specx_components``, says V1)."""
    from vllm_specx.envflags import parse_flag

    value = os.environ.get(V2_RUNNER_ENV, "").strip()
    forced = parse_flag(V2_RUNNER_ENV, value) if value else None
    if forced is False:
        return False, f"{V2_RUNNER_ENV}={value}"
    if v1_reason is not None:
        return False, f"it runs on V1 only: {v1_reason}"
    if forced:
        return True, f"{V2_RUNNER_ENV}={value}"
    if not _vllm_has_triton():
        return False, "vLLM's choice: Model Runner V2 needs Triton"
    return True, "vLLM's default; V1 if vLLM finds a feature V2 lacks, which it logs"


def ragged_graphs_warning(method: str, settings: dict[str, Any], backend: str, on_v2: bool,
                          enforce_eager: bool) -> str | None:
    """The warning logged before start for a ragged config (:func:`drafts_ragged`) on
    CUDA, Model Runner V2, with CUDA graphs: V2 captures its FULL decode graph for one
    query length (1 + K), and a ragged step's queries of 1..K + 1 tokens replay the
    PIECEWISE graphs instead. Measured on an H200 (docs/benchmarks/gpu.md, 2026-11-27):
    0.18-0.19x of no speculation at batch 1. None elsewhere."""
    if backend != "cuda" or not on_v2 or enforce_eager or not drafts_ragged(settings, True):
        return None
    return (f"vllm-specx: '{method}' with these settings drafts a different number of "
            "tokens per request and step; on Model Runner V2 with CUDA graphs such steps "
            "miss the FULL decode graph, and on an NVIDIA H200 this ran at 0.18-0.19x of no "
            "speculation at batch 1 (docs/benchmarks/gpu.md). On a GPU vLLM's own 'eagle3' "
            "or 'draft_model', or this method at a fixed K where it has one, are faster "
            "today; VLLM_SPECX_V2_VARLEN_GRAPHS=1 gives all its decode steps FULL graphs "
            "(experimental: not yet run on a GPU).")


def async_refusal(method: str, settings: dict[str, Any]) -> str:
    """The one-line refusal of ``async_scheduling: true`` for a config whose drafts
    (:func:`~vllm_specx.methods.drafts_ragged`) need synchronous scheduling."""
    spec = METHODS[method]
    if not drafts_ragged(settings, on_v2=True):  # ragged only here, on V1 (a fixed-K head)
        return (f"async_scheduling = true is not allowed with speculative method '{method}' "
                "on Model Runner V1: there the specx chain drafter drafts, synchronously; "
                "on Model Runner V2 a fixed K drafts with vLLM's own speculator and keeps "
                "async scheduling. Leave async_scheduling unset or false on V1.")
    by_control = not tree_on(settings) and not spec.ragged_drafts
    with_knob, fix = (" with draft_tree" if tree_on(settings) else ""), ""
    if by_control:  # mtad's depth control: name its value, default or given
        value = settings.get("cost_control")
        default = " (its default)" if value == spec.knob("cost_control").default else ""
        with_knob = f" with cost_control {json.dumps(value)}{default}"
        fix = ' or set "cost_control": false (K drafts every step)'
    return (f"async_scheduling = true is not allowed with speculative method "
            f"'{method}'{with_knob}: it drafts a different number of tokens per request or "
            f"step, which the scheduler must see; leave async_scheduling unset or false{fix}.")


def runner_announcement(method: str, v1_reason: str | None) -> str:
    """The line logged before start: the model runner the method will run on
    (:func:`runner_choice`) and, on V2, what it captures in CUDA graphs."""
    v2, why = runner_choice(v1_reason)
    if not v2:
        return f"vllm-specx: {method} on Model Runner V1 ({why})"
    declaration = V2_CUDAGRAPH_DECLARATION[METHODS[method].v2_cudagraph]
    return f"vllm-specx: {method} on Model Runner V2 ({why}): {declaration}"


class SpeculativeConfigTranslation(VllmPatch):
    name = "speculative_config_translation"
    target = "vllm.engine.arg_utils:EngineArgs.create_speculative_config"
    replaces = (
        "EngineArgs.create_speculative_config, which merges --spec-* flags into the "
        "speculative-config dict and builds SpeculativeConfig(**dict)"
    )
    why = (
        "SpeculativeConfig.method is a closed Literal and the config forbids unknown keys; "
        "a specx method is validated here, translated into a vLLM base method, and its "
        "settings are carried to every worker in additional_config['specx']. vLLM's own "
        "methods reach the original untouched."
    )

    def wrap(self, original: Any) -> Any:
        def create_speculative_config(self_: Any, target_model_config: Any,
                                      target_parallel_config: Any) -> Any:
            given = self_.speculative_config
            # A string, list or number would fail below with a raw ValueError/TypeError.
            merged = {} if given is None else speculative_config_dict(given)
            flags = (("--spec-method", "method", self_.spec_method),
                     ("--spec-model", "model", self_.spec_model),
                     ("--spec-tokens", "num_speculative_tokens", self_.spec_tokens))
            for _, key, value in flags:
                if value is not None and key not in merged:
                    merged[key] = value
            if self_.speculative_config is None and all(v is None for *_, v in flags):
                return original(self_, target_model_config, target_parallel_config)
            if resolve_method({k.replace("-", "_"): v for k, v in merged.items()},
                              vllm_method_names()) is None:
                # vLLM's own method, before anything platform-specific: specx has no
                # backend for every platform vLLM runs its own methods on (XPU, TPU, ...).
                return original(self_, target_model_config, target_parallel_config)

            from vllm.platforms import current_platform

            from vllm_specx.backends import select_backend

            backend = select_backend()
            result = translate(
                merged,
                vllm_methods=vllm_method_names(),
                vllm_fields=vllm_speculative_fields(),
                limits=backend.limits,
                device=f"{current_platform.device_name} ({backend.name})",
            )
            if result is None:  # vLLM's own method: exactly as without the plugin
                return original(self_, target_model_config, target_parallel_config)
            for flag, key, value in flags:
                if value is not None and key in (self_.speculative_config or {}):
                    raise ValueError(
                        f"{flag} and --speculative-config['{key}'] are mutually exclusive"
                    )
            method = result.specx_settings["method"]
            v1_reason = (METHODS[method].v1_only_reason(result.specx_settings)
                         or device_v1_only_reason(result.specx_settings, backend))
            if env_flag("VLLM_USE_V2_MODEL_RUNNER") and v1_reason is not None:
                raise SpecxConfigError(
                    f'speculative_config["method"] = "{method}" runs on vLLM\'s V1 model '
                    f"runner only ({v1_reason}): unset VLLM_USE_V2_MODEL_RUNNER=1."
                )
            if backend.name == "cuda" and tree_on(result.specx_settings):
                # docs/trees.md "On CUDA and Ascend": TRITON_ATTN, eager and the runner
                # (V1 or V2, as vLLM will pick it) in one line.
                v2, why = runner_choice(v1_reason)
                logger.info("%s", prepare_cuda_tree_engine(
                    self_, target_model_config, method,
                    result.specx_settings.get("draft_tree"),
                    runner=f"Model Runner {'V2' if v2 else 'V1'} ({why})"))
            else:
                # docs/model-runners.md: the runner, and CUDA graphs on V2, before start.
                logger.info("%s", runner_announcement(method, v1_reason))
            for engine_check in METHODS[method].engine_checks:
                engine_check()(target_model_config, result.specx_settings,
                               result.vllm_speculative_config.get("model"))
            refusal = parallelism_refusal(method, result.vllm_speculative_config,
                                          target_model_config, target_parallel_config)
            if refusal is not None:  # docs/scaling-out.md: what runs under TP/DP/PP
                raise refusal
            on_v2 = runner_choice(v1_reason)[0]
            slow = ragged_graphs_warning(method, result.specx_settings, backend.name, on_v2,
                                         bool(getattr(self_, "enforce_eager", False)))
            if slow is not None:
                logger.warning("%s", slow)
            if drafts_ragged(result.specx_settings, on_v2=on_v2):
                # Async scheduling reserves K draft slots per request before the drafter
                # runs; ragged drafts need the scheduler to see the real lengths.
                if self_.async_scheduling:
                    raise SpecxConfigError(async_refusal(method, result.specx_settings))
                self_.async_scheduling = False
            logger.info("vllm-specx: method %r -> vLLM %r with settings %s",
                        result.specx_settings["method"],
                        result.vllm_speculative_config["method"], result.specx_settings)
            self_.speculative_config = dict(result.vllm_speculative_config)
            self_.spec_method = self_.spec_model = self_.spec_tokens = None
            extra = dict(self_.additional_config or {})
            extra[SPECX_CONFIG_KEY] = result.specx_settings
            self_.additional_config = extra
            return original(self_, target_model_config, target_parallel_config)

        return create_speculative_config


class SpecMethodChoices(VllmPatch):
    name = "spec_method_cli_choices"
    target = "vllm.engine.arg_utils:EngineArgs.add_cli_args"
    replaces = "EngineArgs.add_cli_args, which gives --spec-method the choices of vLLM's Literal"
    why = "so that `vllm serve --spec-method mtad` parses; the value is validated later"

    def wrap(self, original: Any) -> Any:
        def add_cli_args(parser: Any) -> Any:
            parser = original(parser)
            for action in parser._actions:
                if action.dest == "spec_method" and action.choices is not None:
                    old = list(action.choices)
                    extra = [m for m in METHODS if m not in old]
                    # vLLM lists None last (the flag is optional); keep that shape.
                    action.choices = [c for c in old if c is not None] + extra + (
                        [None] if None in old else []
                    )
            return parser

        return add_cli_args


class SpecxOnV1Runner(VllmPatch):
    name = "specx_selects_v1_runner"
    target = "vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features"
    replaces = "VllmConfig._get_v2_model_runner_unsupported_features (the V2 opt-out list)"
    why = (
        "a specx method (or setting) that cannot run on V2 (MethodSpec.runs_on_v2, "
        "v1_only_settings) is hooked into the V1 runner only; adding it with its reason "
        "to the list makes vLLM itself pick V1 and log why. What runs on V2 is left to "
        "vLLM's own choice"
    )

    def wrap(self, original: Any) -> Any:
        def unsupported(self_: Any) -> list[str]:
            features = list(original(self_))
            settings = specx_settings(self_)
            spec = METHODS.get(settings["method"]) if settings else None
            reason = ((spec.v1_only_reason(settings) or device_v1_only_reason(settings))
                      if spec is not None else "unknown method") if settings else None
            if reason is not None:
                features.append(
                    f"vllm-specx speculative method '{settings['method']}' ({reason})"
                )
            return features

        return unsupported


class RunnerSpecxComponents(VllmPatch):
    name = "runner_specx_components"
    target = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__"
    replaces = (
        "GPUModelRunner.__init__ (also run by CPUModelRunner), which builds self.drafter "
        "and self.rejection_sampler for the vLLM base method"
    )
    why = (
        "when a specx method is on, the runner must draft with the specx proposer and "
        "verify with the specx sampler; both are swapped in right after construction, "
        "before load_model"
    )
    lazy = True

    def wrap(self, original: Any) -> Any:
        def __init__(self_: Any, vllm_config: Any, device: Any, *args: Any, **kw: Any) -> None:
            original(self_, vllm_config, device, *args, **kw)
            settings = specx_settings(vllm_config)
            from vllm_specx.glue.ascend import runner_is_ascend

            # vLLM-Ascend's runner runs this __init__ too; its own hooks (glue/ascend.py)
            # install the NPU drafter and sampler in its _set_up_drafter.
            if settings and not runner_is_ascend(self_):
                from vllm_specx.glue.runner_hook import install_specx_components

                install_specx_components(self_, settings)

        return __init__


ALL_PATCHES: tuple[VllmPatch, ...] = (
    SpeculativeConfigTranslation(),
    SpecMethodChoices(),
    SpecxOnV1Runner(),
    RunnerSpecxComponents(),
    BeamScratchReservation(),
    *TREE_STEP_PATCHES,  # draft trees on the V1 runner (glue/tree_step.py)
    TritonTreeRoute(),  # draft trees on CUDA (glue/cuda_tree_attention.py)
    *V2_PATCHES,  # Model Runner V2 (glue/v2_patches.py)
    *V2_TREE_STEP_PATCHES,  # draft trees on Model Runner V2 (glue/v2_tree_step.py)
)


def apply_all() -> None:
    for patch in ALL_PATCHES:
        patch.apply()
