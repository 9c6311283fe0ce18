"""The specx seams in vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``), one named
:class:`VllmPatch` each, listed in ``glue/patches.ALL_PATCHES`` and the manifest
(``glue/touchpoints.py``).

* ``v2_specx_speculator`` -- V2 builds its speculator in ``GPUModelRunner.__init__``
  (``init_speculator``, an if/elif chain on vLLM's base method: ``draft_model`` gives
  ``StandaloneARSpeculator``). When a specx method runs on V2 (``MethodSpec.runs_on_v2``),
  the speculator is replaced right after construction, before ``load_model``, by the
  method's ``MethodSpec.v2_speculator`` (``glue/v2_speculators.py``), built with the
  runner so it can read the runner's sampling state.
* ``v2_ragged_draft_lengths`` -- THE mechanism that gives V2's scheduler each request's
  real draft length. V2 hands the scheduler ``[-1] * K`` placeholders per request
  (``DraftTokensHandler.get_draft_tokens``) and reads the draft tokens themselves from its
  own ``req_states.draft_tokens`` when it builds the next step's inputs, taking as many
  per request as the scheduler scheduled. A speculator that drafts a different number of
  tokens per request offers ``take_draft_lengths()`` (request id -> length of the last
  round); ``take_draft_token_ids`` trims each request's list to that length, so the
  scheduler schedules, verifies and counts exactly the drafted tokens (EMS-SD: nothing
  padded to the longest draft), and vLLM's spec-decode metrics see the real lengths.

  This works under synchronous scheduling only: the engine core then calls
  ``take_draft_token_ids`` after every step and before scheduling the next. Under async
  scheduling the scheduler reserves K placeholder slots per request before the drafter
  runs, so a ragged method refuses ``async_scheduling: true`` and turns it off
  (``speculative_config_translation``, ``MethodSpec.ragged_drafts``), on V1 and V2 alike.

No V2 import at module level: the plugin registers these in every process, cheaply; the
V2 runner module is patched when vLLM imports it.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_specx.config import SpecxConfigError, specx_settings
from vllm_specx.glue.patch_base import VllmPatch
from vllm_specx.methods import METHODS, draft_model_tree, drafts_ragged, tree_on

logger = logging.getLogger("vllm.specx")

__all__ = ["V2_PATCHES", "V2PlainStepGraphs", "V2RaggedDraftLengths", "V2SpecxSampler",
           "V2SpecxSpeculator", "V2VarlenDecodeGraphs", "add_plain_step_graphs",
           "install_v2_speculator", "use_varlen_decode_graphs", "varlen_decode_refusal"]


def install_v2_speculator(runner: Any, settings: dict[str, Any]) -> None:
    """Replace ``runner.speculator`` (V2) by the specx method's V2 speculator.

    Called right after ``GPUModelRunner.__init__`` (V2), before ``load_model``; the
    speculator gets the validated ``settings`` before its draft model loads."""
    method = settings["method"]
    spec = METHODS.get(method)
    factory = spec.v2_speculator if spec is not None else None
    if spec is not None and spec.v1_only_reason(settings) is None and factory is None:
        # vLLM's own V2 speculator for the base method drafts (specx_mtp / specx_eagle3
        # at a fixed K); the specx sampler verifies (v2_specx_sampler).
        return
    if spec is None or spec.v1_only_reason(settings) is not None or factory is None:
        # specx_selects_v1_runner keeps such a method on V1; reaching this is a bug, or a
        # V2 runner forced by another plugin.
        raise SpecxConfigError(
            f'speculative_config["method"] = "{method}" has no Model Runner V2 speculator '
            f"in this version of vllm-specx ({spec.v1_reason if spec else 'unknown method'})"
            "; run it on the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0)."
        )
    drafter_settings = dict(settings)
    if draft_model_tree(settings) is not None:
        # adaptive with draft_tree: the tree is drafted by the MTAD round's beam passes,
        # as on V1 (runner_hook.install_specx_components).
        from vllm_specx.glue.mtad_proposer import tree_drafter_settings
        from vllm_specx.glue.v2_speculators import DraftTreeV2Speculator

        factory, drafter_settings = (lambda: DraftTreeV2Speculator), tree_drafter_settings(
            settings)
    speculator = factory()(runner.vllm_config, runner.device, runner)
    speculator.settings = drafter_settings
    runner.speculator = speculator
    if tree_on(settings):
        # Draft trees on V2 (glue/v2_tree_step.py): the state the speculator, the specx
        # sampler (install_v2_sampler) and the runner's V2 tree-step patches share.
        from vllm_specx.glue.runner_hook import new_tree_state

        speculator.tree_state = new_tree_state(runner, settings)
    logger.info("vllm-specx: %s on Model Runner V2 with speculator %s", method,
                type(speculator).__name__)


class V2SpecxSpeculator(VllmPatch):
    name = "v2_specx_speculator"
    target = "vllm.v1.worker.gpu.model_runner:GPUModelRunner.__init__"
    replaces = (
        "Model Runner V2's GPUModelRunner.__init__ (also run by V2's CPUModelRunner), "
        "which builds self.speculator with init_speculator for the vLLM base method"
    )
    why = (
        "a specx method that runs on V2 drafts with its own V2 speculator "
        "(MethodSpec.v2_speculator); it is swapped in right after construction, before "
        "load_model, so its draft model loads and gets its KV cache the normal way"
    )
    lazy = True

    def wrap(self, original: Any) -> Any:
        def __init__(self_: Any, vllm_config: Any, device: Any, *args: Any, **kw: Any) -> None:
            original(self_, vllm_config, device, *args, **kw)
            settings = specx_settings(vllm_config)
            # Only the last pipeline rank drafts (V2 builds no speculator elsewhere).
            if settings and self_.speculator is not None:
                install_v2_speculator(self_, settings)

        return __init__


class V2RaggedDraftLengths(VllmPatch):
    name = "v2_ragged_draft_lengths"
    target = "vllm.v1.worker.gpu.model_runner:GPUModelRunner.take_draft_token_ids"
    replaces = (
        "Model Runner V2's GPUModelRunner.take_draft_token_ids, which hands the scheduler "
        "K draft slots ([-1] * K placeholders) for every request"
    )
    why = (
        "a specx speculator that drafts a different number of tokens per request "
        "(take_draft_lengths()) must have the scheduler schedule and verify exactly "
        "those; each request's list is trimmed to its real length (synchronous "
        "scheduling: called after every step, before the next is scheduled)"
    )
    lazy = True

    def wrap(self, original: Any) -> Any:
        def take_draft_token_ids(self_: Any) -> Any:
            out = original(self_)
            take = getattr(getattr(self_, "speculator", None), "take_draft_lengths", None)
            lengths = take() if take is not None else None
            if out is None or not lengths:
                return out
            trimmed = [
                list(ids[: lengths[req_id]]) if req_id in lengths else list(ids)
                for req_id, ids in zip(out.req_ids, out.draft_token_ids)
            ]
            return type(out)(out.req_ids, trimmed)

        return take_draft_token_ids


class V2SpecxSampler(VllmPatch):
    name = "v2_specx_sampler"
    target = "vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model"
    replaces = (
        "Model Runner V2's GPUModelRunner.load_model, which builds self.rejection_sampler "
        "(V2's RejectionSampler, or ModelState.custom_sampler's) for the loaded model"
    )
    why = (
        "a specx method on V2 verifies with its own rule (MethodSpec.rule) through the "
        "specx backend: V2's RejectionSampler is replaced right after load_model by its "
        "subclass SpecxV2RejectionSampler (glue/v2_sampler.py), which changes only "
        "_verify; vLLM's own methods keep vLLM's sampler. Also gives an EAGLE-3 target "
        "the auxiliary layers the head's eagle_config names (V2 reads only the top-level "
        "key; glue/v2_sampler.align_eagle3_aux_layers)"
    )
    lazy = True

    def wrap(self, original: Any) -> Any:
        def load_model(self_: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self_, *args, **kwargs)
            settings = specx_settings(self_.vllm_config)
            if settings and getattr(self_, "rejection_sampler", None) is not None:
                from vllm_specx.glue.v2_sampler import align_eagle3_aux_layers, install_v2_sampler

                install_v2_sampler(self_, settings)
                align_eagle3_aux_layers(self_)
            return result

        return load_model


# Opt-in until a GPU run has shown the plain-step graphs lossless (docs/model-runners.md
# "CUDA graphs on V2"); read once per engine, when V2 builds its graph manager.
PLAIN_STEP_GRAPHS_ENV = "VLLM_SPECX_V2_PLAIN_STEP_GRAPHS"


def add_plain_step_graphs(manager: Any) -> list[int]:
    """Give a V2 ``ModelCudaGraphManager`` FULL decode graphs for 1-token queries too.

    V2 captures its FULL decode graphs for one query length, ``decode_query_len`` = 1 + K,
    and a batch of other uniform lengths replays the PIECEWISE graphs. A ragged specx
    method's plain step (cost control planned no drafts: every request's query is the
    one token just sampled) is such a batch. vLLM's own candidate builder
    (``_init_candidates``) is run a second time with ``decode_query_len`` = 1, as vLLM
    runs it over several lengths for its dynamic speculative decoding, and its FULL
    descriptors join the manager's: captured with the rest, and preferred by
    ``dispatch`` for a uniform 1-token batch (a FULL descriptor matches only its own
    ``uniform_token_count``; PIECEWISE ones stay last). Returns the token counts of the
    added graphs (none when the mode has no separate FULL decode routine)."""
    from vllm.config import CUDAGraphMode

    decode_mode = manager.cudagraph_mode.decode_mode() if manager.cudagraph_mode else None
    if (decode_mode != CUDAGraphMode.FULL or not manager.cudagraph_mode.separate_routine()
            or manager.varlen_decode or manager.decode_query_len <= 1):
        return []
    own_capture, own_candidates = manager._capture_descs, manager._candidates
    query_len = manager.decode_query_len
    manager._capture_descs, manager._candidates = {}, {}
    manager.decode_query_len = 1
    try:
        manager._init_candidates()
        plain = [d for d in manager._capture_descs.get(decode_mode, [])
                 if d.uniform_token_count == 1]
        plain_candidates = manager._candidates
    finally:
        manager.decode_query_len = query_len
        manager._capture_descs, manager._candidates = own_capture, own_candidates
    if not plain:
        return []
    descs = own_capture.setdefault(decode_mode, [])
    descs.extend(d for d in plain if d not in descs)
    descs.sort(key=lambda d: d.num_tokens, reverse=True)
    for key, candidates in plain_candidates.items():
        added = [d for d in candidates if d.uniform_token_count == 1
                 and d.cg_mode == decode_mode]
        have = own_candidates.setdefault(key, [])
        full = [d for d in have if d.cg_mode == CUDAGraphMode.FULL]
        rest = [d for d in have if d.cg_mode != CUDAGraphMode.FULL]
        own_candidates[key] = full + [d for d in added if d not in full] + rest
    return sorted(d.num_tokens for d in plain)


class V2PlainStepGraphs(VllmPatch):
    name = "v2_plain_step_graphs"
    target = "vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager.__init__"
    replaces = (
        "Model Runner V2's ModelCudaGraphManager.__init__, which plans FULL decode graphs "
        "for one query length (1 + K tokens per request) and PIECEWISE graphs for the rest"
    )
    why = (
        "a ragged specx method (adaptive stop, cost control) mostly runs plain steps of one "
        "token per request, which replay PIECEWISE graphs (measured: 4.5x a plain step of "
        "vLLM on an H200); with VLLM_SPECX_V2_PLAIN_STEP_GRAPHS=1 the manager also plans "
        "FULL decode graphs for 1-token queries (add_plain_step_graphs). Opt-in: not yet "
        "run on a GPU"
    )
    lazy = True

    def wrap(self, original: Any) -> Any:
        def __init__(self_: Any, vllm_config: Any, *args: Any, **kw: Any) -> None:
            original(self_, vllm_config, *args, **kw)
            settings = specx_settings(vllm_config)
            if not settings or not drafts_ragged(settings, on_v2=True):
                return
            from vllm_specx.envflags import env_flag

            if not env_flag(PLAIN_STEP_GRAPHS_ENV):
                return
            sizes = add_plain_step_graphs(self_)
            if sizes:
                logger.info("vllm-specx: %s on Model Runner V2 also captures FULL decode "
                            "graphs for 1-token queries (plain steps), token counts %s "
                            "(%s=1, not yet run on a GPU)", settings["method"], sizes,
                            PLAIN_STEP_GRAPHS_ENV)

        return __init__


# Opt-in until a GPU run has shown the varlen decode graphs lossless and faster
# (docs/model-runners.md "CUDA graphs on V2"); read once per engine, when V2 sets up
# its KV cache and graph manager.
VARLEN_GRAPHS_ENV = "VLLM_SPECX_V2_VARLEN_GRAPHS"


def varlen_decode_refusal(runner: Any) -> str | None:
    """Why this V2 runner's decode steps cannot replay varlen decode graphs (None: they
    can), checked as vLLM checks it for its own adaptive verification
    (``maybe_create_adaptive_verification_manager``): the graph mode has FULL decode
    graphs of their own (``decode_mode() == FULL`` and a separate decode routine, so a
    prefill never replays them), and every attention backend of the target's layers
    replays FULL graphs of decode batches with 1 to ``decode_query_len`` tokens per
    request (``get_varlen_cudagraph_unsupported_backend``; FlashAttention 3 and
    Triton attention do, whatever the lengths). Not with DBO micro-batching or
    ``kv_sharing_fast_prefill`` (both hold the graph manager vLLM built)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.worker.gpu.attn_utils import get_varlen_cudagraph_unsupported_backend

    manager = getattr(runner, "cudagraph_manager", None)
    mode = getattr(manager, "cudagraph_mode", None)
    if mode is None or mode == CUDAGraphMode.NONE:
        return "no CUDA graphs (enforce_eager, or a platform without them)"
    if manager.varlen_decode:
        return "vLLM already plans varlen decode graphs (its adaptive verification)"
    if mode.decode_mode() != CUDAGraphMode.FULL or not mode.separate_routine():
        return (f"cudagraph_mode {mode.name} has no FULL decode graphs of their own "
                "(FULL_AND_PIECEWISE or FULL_DECODE_ONLY has)")
    if manager.ubatch_runner is not None:
        return "DBO micro-batching captures uniform decode graphs only"
    if getattr(runner, "fast_prefill", None) is not None:
        return "kv_sharing_fast_prefill keeps vLLM's graph manager"
    draft_layers = getattr(runner.speculator, "draft_attn_layer_names", None) or set()
    target_layers = {name for group in runner.kv_cache_config.kv_cache_groups
                     for name in group.layer_names} - set(draft_layers)
    unsupported = get_varlen_cudagraph_unsupported_backend(
        runner.attn_groups, runner.vllm_config, manager.decode_query_len,
        checked_layer_names=target_layers)
    if unsupported is None:
        support, backend = runner.model_state.get_additional_cg_support()
        if support != AttentionCGSupport.ALWAYS:
            unsupported = backend, None
    if unsupported is not None:
        backend, bound = unsupported
        can = ("cannot replay FULL graphs of decode batches whose query lengths vary"
               if bound is None else f"replays varlen decode graphs of at most {bound} "
               "tokens a request")
        return (f"the {backend} attention backend {can}, and these steps have up to "
                f"{manager.decode_query_len}")
    return None


def use_varlen_decode_graphs(runner: Any) -> bool:
    """Rebuild a V2 runner's graph manager with varlen decode graphs, as vLLM builds it
    for its own adaptive verification (``ModelCudaGraphManager(varlen_decode=True)``):
    FULL decode graphs that replay any decode batch of 1 to ``decode_query_len`` (1 + K)
    tokens per request, in place of the graphs of exactly 1 + K. A ragged specx method's
    steps (a draft of 0..K tokens per request, a plain step where nobody drafts) then
    replay FULL graphs instead of the PIECEWISE ones. Called before anything is captured
    (right after ``initialize_kv_cache``); the runner's ``execute_model`` already hands
    ``dispatch`` each decode batch's largest query length (a batch with a prefill gets
    none, and replays PIECEWISE graphs). Returns whether it did; logs why not."""
    from vllm_specx.envflags import env_flag

    if not env_flag(VARLEN_GRAPHS_ENV):
        return False
    settings = specx_settings(runner.vllm_config)
    if not settings or not drafts_ragged(settings, on_v2=True) or tree_on(settings):
        return False  # a fixed K is vLLM's own uniform graph; trees run eager
    reason = varlen_decode_refusal(runner)
    if reason is not None:
        logger.warning("vllm-specx: %s=1 is not used: %s", VARLEN_GRAPHS_ENV, reason)
        return False
    old = runner.cudagraph_manager
    runner.cudagraph_manager = type(old)(
        runner.vllm_config, runner.device, old.cudagraph_mode,
        decode_query_len=old.decode_query_len, lora_capture_cases=old.lora_capture_cases,
        varlen_decode=True, ubatch_runner=old.ubatch_runner)
    logger.info("vllm-specx: %s on Model Runner V2 captures varlen decode graphs (1 to %d "
                "tokens a request, %s=1, not yet run on a GPU)", settings["method"],
                old.decode_query_len, VARLEN_GRAPHS_ENV)
    return True


class V2VarlenDecodeGraphs(VllmPatch):
    name = "v2_varlen_decode_graphs"
    target = "vllm.v1.worker.gpu.model_runner:GPUModelRunner.initialize_kv_cache"
    replaces = (
        "Model Runner V2's GPUModelRunner.initialize_kv_cache, which builds the graph "
        "manager with varlen decode graphs only for vLLM's own adaptive verification"
    )
    why = (
        "a ragged specx method's decode steps (0..K drafts per request) miss V2's FULL "
        "decode graph of exactly 1 + K tokens a request (measured: 0.18-0.19x of no "
        "speculation on an H200); with VLLM_SPECX_V2_VARLEN_GRAPHS=1 the manager is "
        "rebuilt with varlen_decode=True where the attention backends allow it "
        "(use_varlen_decode_graphs). Opt-in: not yet run on a GPU"
    )
    lazy = True

    def wrap(self, original: Any) -> Any:
        def initialize_kv_cache(self_: Any, *args: Any, **kw: Any) -> Any:
            result = original(self_, *args, **kw)
            use_varlen_decode_graphs(self_)
            return result

        return initialize_kv_cache


V2_PATCHES: tuple[VllmPatch, ...] = (V2SpecxSpeculator(), V2RaggedDraftLengths(),
                                     V2SpecxSampler(), V2PlainStepGraphs(),
                                     V2VarlenDecodeGraphs())
