"""Every place vllm-specx touches vLLM, in one manifest, and the upgrade checklist.

Two kinds of touch-point:

**Patches** -- anything that changes vLLM's objects at run time. Most are
:class:`~vllm_specx.glue.patch_base.VllmPatch` objects kept where their reason lives;
the others (a ``torch.library`` registration, a class swap, instance-level wraps) are
listed here with the same fields. ``scope`` says where each applies:

* ``always`` -- every process that loads the plugin (vLLM calls ``plugin.register``);
* ``cpu-reference`` -- vLLM on the CPU platform without its compiled CPU ops, i.e. when
  :mod:`vllm_specx.cpu_ops` registers the PyTorch reference ops;
* ``bench`` -- during a ``vllm-specx bench`` run only, removed after it;
* ``ascend`` -- vLLM-Ascend's NPU runner: applied when vLLM-Ascend imports the target
  module. Their targets are vLLM-Ascend's, checked against the fake vLLM-Ascend in
  ``tests/ascend/fakes`` (mirrored from the commit in ``vllm_specx.glue.ascend``), not
  against the installed vLLM; ``verified_on`` names that vLLM-Ascend source.

Patches (name -- scope -- what in vLLM changes):

* speculative_config_translation -- always -- ``EngineArgs.create_speculative_config``
* spec_method_cli_choices -- always -- ``EngineArgs.add_cli_args``
* specx_selects_v1_runner -- always -- ``VllmConfig._get_v2_model_runner_unsupported_features``
* runner_specx_components -- always -- ``GPUModelRunner.__init__`` (when vLLM imports it)
* mtad_beam_scratch_reservation -- always -- ``Scheduler.__init__`` (when vLLM imports it)
* tree_step_inputs -- always -- ``GPUModelRunner._prepare_inputs`` (when vLLM imports it)
* tree_step_masks -- always -- ``GPUModelRunner._model_forward`` (when vLLM imports it)
* tree_step_compaction -- always -- ``GPUModelRunner._sample`` (when vLLM imports it)
* triton_attention_tree_route -- always -- ``TritonAttentionImpl.forward`` (when vLLM imports
  it)
* v2_specx_speculator -- always -- Model Runner V2's ``GPUModelRunner.__init__`` (when vLLM
  imports it)
* v2_ragged_draft_lengths -- always -- Model Runner V2's
  ``GPUModelRunner.take_draft_token_ids`` (when vLLM imports it)
* v2_specx_sampler -- always -- Model Runner V2's ``GPUModelRunner.load_model`` (when vLLM
  imports it)
* v2_plain_step_graphs -- always -- Model Runner V2's ``ModelCudaGraphManager.__init__`` (when
  vLLM imports it)
* v2_varlen_decode_graphs -- always -- Model Runner V2's ``GPUModelRunner.initialize_kv_cache``
  (when vLLM imports it)
* v2_tree_step_inputs -- always -- Model Runner V2's ``GPUModelRunner.prepare_attn`` (when
  vLLM imports it)
* v2_tree_step_forward -- always -- Model Runner V2's ``GPUModelRunner.execute_model`` (when
  vLLM imports it)
* v2_tree_step_compaction -- always -- Model Runner V2's ``GPUModelRunner.sample`` (when vLLM
  imports it)
* cpu_adapter_compute_slot_mapping_kernel -- cpu-reference --
  ``cpu_triton_utils._compute_slot_mapping_kernel_impl``
* cpu_adapter_expand_kernel -- cpu-reference -- ``cpu_triton_utils._expand_kernel_impl``
* cpu_tolerant_kernel_rebind -- cpu-reference -- ``triton_utils.dispatcher._rebind_kernels``
* cpu_override_registration_once -- cpu-reference --
  ``CpuPlatform.register_triton_kernel_overrides``
* cpu_seeded_partial_prefill -- cpu-reference -- ``GPUModelRunner.sample_tokens`` (when vLLM
  imports it)
* cpu_top_k_only_empty_batch -- cpu-reference -- ``topk_topp_sampler.apply_top_k_only``
* cpu_v2_top_k_top_p_sampler -- cpu-reference -- Model Runner V2's
  ``sample.sampler.apply_top_k_top_p`` (when vLLM imports it)
* cpu_v2_top_k_top_p_states -- cpu-reference -- Model Runner V2's
  ``sample.states.apply_top_k_top_p`` (when vLLM imports it)
* cpu_reference_mla_on_amx_hosts -- cpu-reference -- ``CpuPlatform.check_and_update_config``
* cpu_onednn_packed_linear -- cpu-reference -- ``layers.utils.dispatch_cpu_unquantized_gemm``
* cpu_reference_op_library -- cpu-reference -- ``torch.ops._C``: ops defined as a FRAGMENT
* cpu_ops_namespace_guard -- cpu-reference -- ``type(torch.ops._C)`` swapped for a subclass
* bench_forward_timers -- bench -- the runner's models: hooks (or a ``forward`` instance
  attribute) and a ``compute_logits`` instance attribute
* bench_propose_counter -- bench -- ``runner.drafter.propose`` (instance attribute)
* ascend_specx_validation -- ascend -- ``NPUPlatform.check_and_update_config``
* ascend_proposer_dispatch -- ascend -- ``NPUModelRunner._get_drafter``
* ascend_specx_sampler -- ascend -- ``NPUModelRunner._set_up_drafter``

**Private vLLM names** -- :data:`PRIVATE_NAMES`: every underscore name of vLLM (and the
few names of vLLM objects' internals) that our code reads, calls, assigns or passes.
vLLM may rename them in any release without notice.

``tests/glue/test_touchpoints.py`` checks the installed vLLM has every patch target and
every private name (failing with "vLLM X no longer has Y, used by Z"), that every patch
was verified on the installed release, that this table and the docs' patch manifest
(docs/contributing/patches.md) list every patch, and that the package uses no underscore
name missing from this manifest. The nightly CI job runs it against vLLM's newest build.

Upgrade checklist (new vLLM release ``R``; docs/cpu-reference-backend.md for the CPU ops):

1. Install ``R`` next to the current release (``scripts/test_vllm033.sh`` shows how for
   a release that cannot be installed normally) and run
   ``pytest tests/glue/test_touchpoints.py``: it names every target and private name
   that moved.
2. For each patch, re-read its ``target`` in ``R`` (``git diff`` of vLLM between the
   releases) and confirm ``replaces``/``why`` still describe it; for each private name,
   confirm it still means what ``why`` says.
3. Add ``R`` to the drift table in :mod:`vllm_specx.cpu_ops.schemas` after diffing
   ``csrc/cpu/torch_bindings.cpp`` for every op listed there.
4. Add ``R`` to :data:`~vllm_specx.glue.patch_base.VERIFIED_RELEASES`, widen
   ``SUPPORTED_VLLM`` in setup.py, run the whole suite under ``R``, update the docs.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

from vllm_specx.glue.patch_base import VERIFIED_RELEASES, VllmPatch

ALWAYS = "always"
CPU_REFERENCE = "cpu-reference"
BENCH = "bench"
ASCEND = "ascend"
SCOPES: tuple[str, ...] = (ALWAYS, CPU_REFERENCE, BENCH, ASCEND)


@dataclass(frozen=True)
class TouchPoint:
    """One patch of vLLM, whatever its mechanism."""

    name: str
    scope: str
    target: str  # what in vLLM changes
    replaces: str
    why: str
    defined_in: str  # "module:name" of the code that does it
    verified_on: tuple[str, ...]
    # "module:Qualified.attr" that must exist for the patch to make sense, if any
    # (a VllmPatch's target); None where the target is not a vLLM attribute.
    vllm_attribute: str | None = None


# Patches that are not VllmPatch objects: what they change is not one attribute of a
# vLLM class or module.
OTHER_PATCHES: tuple[TouchPoint, ...] = (
    TouchPoint(
        name="cpu_reference_op_library",
        scope=CPU_REFERENCE,
        target="torch.ops._C: the ops of vLLM's CPU build, defined through a "
        "torch.library FRAGMENT of the '_C' namespace",
        replaces="the C++ ops that only vLLM's CPU build compiles into vllm._C",
        why="the PyPI wheel is a CUDA build; its CPU engine calls ops the wheel lacks. "
        "Schemas come from the drift table of the installed release",
        defined_in="vllm_specx.cpu_ops:_define_ops",
        verified_on=(),  # the drift table's releases; see patches()
    ),
    TouchPoint(
        name="cpu_ops_namespace_guard",
        scope=CPU_REFERENCE,
        target="type(torch.ops._C), swapped for a subclass whose __getattr__ names the "
        "missing op",
        replaces="torch's bare AttributeError for an unregistered torch.ops._C.<op>",
        why="a missing reference op then fails with the op and the vLLM release, and "
        "vLLM's hasattr() probes still see False (the error subclasses AttributeError)",
        defined_in="vllm_specx.cpu_ops.drift:install_namespace_guard",
        verified_on=(),
    ),
    TouchPoint(
        name="bench_forward_timers",
        scope=BENCH,
        target="the runner's target and draft model instances: forward pre/post hooks "
        "(or, for a @support_torch_compile model such as an MTP drafter, whose __call__ "
        "skips hooks, an instance attribute shadowing forward) and an instance attribute "
        "shadowing compute_logits",
        replaces="nothing: the originals run unchanged inside the timers",
        why="per-forward times of each model during the timed part of a bench run; "
        "removed when the run is collected",
        defined_in="vllm_specx.bench.engine_run:_ForwardTimer",
        verified_on=VERIFIED_RELEASES,
    ),
    TouchPoint(
        name="bench_propose_counter",
        scope=BENCH,
        target="runner.drafter.propose, shadowed by an instance attribute",
        replaces="nothing: the original is called",
        why="counts drafting rounds during a bench run; removed when the run is collected",
        defined_in="vllm_specx.bench.engine_run:_CallCounter",
        verified_on=VERIFIED_RELEASES,
    ),
)


def _vllm_patch_registries() -> list[tuple[str, list[VllmPatch]]]:
    """Where each VllmPatch lives, with its objects (imports torch for the CPU ones)."""
    from vllm_specx.cpu_ops import kernel_overrides, linear, vllm_fixes
    from vllm_specx.glue import ascend, patches

    return [
        ("vllm_specx.glue.patches:ALL_PATCHES", list(patches.ALL_PATCHES)),
        ("vllm_specx.glue.ascend:ASCEND_PATCHES", list(ascend.ASCEND_PATCHES)),
        ("vllm_specx.cpu_ops.kernel_overrides:PATCHES", list(kernel_overrides.PATCHES.values())),
        ("vllm_specx.cpu_ops.vllm_fixes:FIXES", list(vllm_fixes.FIXES.values())),
        ("vllm_specx.cpu_ops.linear:PATCHES", list(linear.PATCHES.values())),
    ]


def patches() -> list[TouchPoint]:
    """Every patch vllm-specx can apply to vLLM, VllmPatch objects first."""
    from vllm_specx.cpu_ops.schemas import supported_releases

    out = [
        TouchPoint(
            name=p.name,
            scope=p.scope,
            target=p.target,
            replaces=p.replaces,
            why=p.why,
            defined_in=registry,
            verified_on=tuple(p.verified_on),
            vllm_attribute=p.target,
        )
        for registry, objects in _vllm_patch_registries()
        for p in objects
    ]
    for other in OTHER_PATCHES:
        if other.scope == CPU_REFERENCE:
            # Defined for exactly the releases the drift table knows.
            other = dataclasses.replace(other, verified_on=tuple(supported_releases()))
        out.append(other)
    return out


@dataclass(frozen=True)
class PrivateName:
    """A vLLM name that is not public API and that our code relies on."""

    owner: str  # "module" or "module:Qualified" holding the name
    name: str
    # "attribute": hasattr(owner, name) -- methods, class attributes, module globals;
    # "field": a dataclass field of owner; "instance attribute": assigned as
    # ``self.<name>`` in the source of owner or a base class; "source": the name
    # appears in owner's module source (e.g. an attribute set on foreign objects).
    kind: str
    used_by: tuple[str, ...]  # our modules that rely on it
    why: str

    def missing(self, vllm_version: str) -> str | None:
        """None when the installed vLLM still has the name, else the one-line reason."""
        try:
            owner = resolve(self.owner)
        except (ImportError, AttributeError) as exc:
            return self._message(vllm_version, f"{self.owner} ({type(exc).__name__}: {exc})")
        found = {
            "attribute": lambda: hasattr(owner, self.name),
            "field": lambda: self.name in _field_names(owner),
            "instance attribute": lambda: _assigns_on_self(owner, self.name),
            "source": lambda: self.name in inspect.getsource(inspect.getmodule(owner)),
        }[self.kind]()
        if found:
            return None
        return self._message(vllm_version, f"{self.owner}.{self.name} ({self.kind})")

    def _message(self, vllm_version: str, what: str) -> str:
        return (
            f"vLLM {vllm_version} no longer has {what}, used by {', '.join(self.used_by)} "
            f"({self.why})"
        )


def resolve(path: str) -> Any:
    """``"pkg.module:Outer.Inner"`` (or ``"pkg.module"``) -> the object."""
    module_name, _, qualified = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, qualified.split(".")):
        obj = getattr(obj, part)
    return obj


def _field_names(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in inspect.getmro(cls):
        names.update(getattr(klass, "__annotations__", {}))
    if dataclasses.is_dataclass(cls):
        names.update(f.name for f in dataclasses.fields(cls))
    return names


def _assigns_on_self(cls: type, name: str) -> bool:
    pattern = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]+)?=(?!=)")
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if pattern.search(source):
            return True
    return False


_DRAFTER = "vllm.v1.spec_decode.draft_model:DraftModelProposer"
_DRAFT_GLUE = ("vllm_specx/glue/draft_passes.py", "vllm_specx/glue/mtad_proposer.py")

_V2_AR = "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator:StandaloneARSpeculator"
_V2_GLUE = ("vllm_specx/glue/v2_speculators.py",)
PRIVATE_NAMES: tuple[PrivateName, ...] = (
    # --- the specx drafters (subclasses of vLLM's draft-model proposer) -------------
    PrivateName(_DRAFTER, "_determine_batch_execution_and_padding", "attribute", _DRAFT_GLUE,
                "CUDA-graph mode and padded token count of a draft pass"),
    PrivateName(_DRAFTER, "_get_slot_mapping", "attribute", _DRAFT_GLUE,
                "padded slot mapping of a draft pass"),
    PrivateName(_DRAFTER, "_get_positions", "attribute", _DRAFT_GLUE,
                "the positions buffer of a draft pass"),
    PrivateName(_DRAFTER, "_slot_mapping_buffer", "instance attribute",
                ("vllm_specx/glue/draft_passes.py",),
                "the drafter's slot-mapping input buffer, which vLLM's fused EAGLE step "
                "kernel writes in place for a chain pass (padding slots included)"),
    PrivateName(_DRAFTER, "set_inputs_first_pass", "attribute", _DRAFT_GLUE,
                "the base class's first pass, run on its own before specx passes"),
    PrivateName(_DRAFTER, "build_model_inputs_first_pass", "attribute", _DRAFT_GLUE,
                "model inputs of the first pass"),
    PrivateName(_DRAFTER, "build_per_group_and_layer_attn_metadata", "attribute", _DRAFT_GLUE,
                "attention metadata of every draft pass"),
    PrivateName(_DRAFTER, "input_ids", "instance attribute", _DRAFT_GLUE,
                "persistent input buffer the draft passes fill"),
    PrivateName(_DRAFTER, "positions", "instance attribute", _DRAFT_GLUE,
                "persistent positions buffer the draft passes fill"),
    PrivateName(_DRAFTER, "inputs_embeds", "instance attribute", _DRAFT_GLUE,
                "persistent embeddings buffer (multimodal drafts)"),
    PrivateName(_DRAFTER, "eplb_state", "instance attribute", _DRAFT_GLUE,
                "expert-load bookkeeping run before each draft forward"),
    PrivateName(_DRAFTER, "_draft_attn_layer_names", "instance attribute",
                ("vllm_specx/glue/beam_kv.py",),
                "the draft's attention layers, whose caches get the beams' partial-block copies"),
    PrivateName("vllm.v1.attention.backend:CommonAttentionMetadata",
                "_num_computed_tokens_cache", "field", _DRAFT_GLUE,
                "cleared when a draft pass rebuilds the metadata for other rows"),
    PrivateName("vllm.v1.attention.backend:CommonAttentionMetadata",
                "_token_to_req_indices_cache", "field", _DRAFT_GLUE,
                "cleared when a draft pass rebuilds the metadata for other rows"),
    # --- the specx draft-model speculators on Model Runner V2 ---------------------------
    PrivateName(_V2_AR, "_prefill", "attribute", _V2_GLUE,
                "vLLM's V2 first draft pass (verified tokens + the new token + rejected "
                "slots); the specx round starts from the hidden state it samples from"),
    PrivateName(_V2_AR, "_run_model", "attribute", _V2_GLUE,
                "one draft forward in vLLM's forward context (the lookahead passes)"),
    PrivateName("vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator",
                "_copy_request_inputs", "attribute", _V2_GLUE,
                "copies the batch's temperature, seeds and request-state rows before the "
                "first pass, as vLLM's propose does"),
    *(PrivateName("vllm.v1.worker.gpu.input_batch:InputBatch", name, "field", _V2_GLUE,
                  "a skipped first pass's draft-KV hole: each request's first query "
                  "position and query length, and its request-state row (DraftKVHoles)")
      for name in ("num_computed_tokens_np", "query_start_loc_np", "idx_mapping_np")),
    PrivateName("vllm.v1.worker.gpu.states:RequestState", "all_token_ids",
                "instance attribute", _V2_GLUE,
                "the committed tokens a draft-KV catch-up feeds (V2CommittedTokens)"),
    PrivateName("vllm.v1.worker.gpu.states:RequestState", "req_id_to_index",
                "instance attribute", ("vllm_specx/glue/v2_eagle.py",),
                "the V2 runner's unfinished requests: an EAGLE/MTP head's kept first-pass "
                "inputs of the others are dropped (HeadKVHoles)"),
    # --- plain-step graphs on Model Runner V2 (opt-in) ------------------------------------
    PrivateName("vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager", "_init_candidates",
                "attribute", ("vllm_specx/glue/v2_patches.py",),
                "vLLM's graph planning, run again for 1-token decode queries "
                "(add_plain_step_graphs)"),
    *(PrivateName("vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager", name,
                  "instance attribute", ("vllm_specx/glue/v2_patches.py",),
                  "the graphs to capture by mode, and each token count's candidates in "
                  "dispatch order: the 1-token FULL decode graphs join them")
      for name in ("_capture_descs", "_candidates")),
    # --- varlen decode graphs on Model Runner V2 (opt-in) --------------------------------
    *(PrivateName("vllm.v1.worker.gpu.model_runner:GPUModelRunner", name,
                  "instance attribute", ("vllm_specx/glue/v2_patches.py",),
                  "what initialize_kv_cache built: the graph manager rebuilt with varlen "
                  "decode graphs, and what vLLM's own varlen check reads (the attention "
                  "groups of the target's layers, its extra groups' support, fast prefill)")
      for name in ("cudagraph_manager", "kv_cache_config", "model_state", "fast_prefill")),
    # Assigned by tuple unpacking (``self.attn_groups, ... = init_attn_backend(...)``).
    PrivateName("vllm.v1.worker.gpu.model_runner:GPUModelRunner", "attn_groups",
                "source", ("vllm_specx/glue/v2_patches.py",),
                "the attention groups vLLM's varlen check reads"),
    *(PrivateName("vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager", name,
                  "instance attribute", ("vllm_specx/glue/v2_patches.py",),
                  "the arguments vLLM built its graph manager with, passed again when it "
                  "is rebuilt with varlen_decode=True")
      for name in ("cudagraph_mode", "decode_query_len", "lora_capture_cases",
                   "varlen_decode", "ubatch_runner")),
    # --- the specx sampler --------------------------------------------------------------
    PrivateName("vllm.v1.sample.rejection_sampler:RejectionSampler", "_get_logprobs_tensors",
                "attribute", ("vllm_specx/glue/sampler.py",),
                "logprobs of verified tokens, computed exactly as vLLM does"),
    PrivateName("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator:"
                "TargetDependentARSpeculator", "_run_model", "attribute",
                ("vllm_specx/glue/v2_eagle.py",),
                "one MTP / EAGLE draft forward over the speculator's input buffers and "
                "hidden_states; the adaptive round's lookahead passes call it"),
    PrivateName("vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler",
                "_verify", "attribute", ("vllm_specx/glue/v2_sampler.py",),
                "Model Runner V2's verification step (warped logits in, [num_reqs, K + 1] "
                "tokens and their count out); the specx V2 sampler overrides it"),
    PrivateName("vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler",
                "_verify_in_chunks", "attribute", ("vllm_specx/glue/v2_sampler.py",),
                "calls _verify per chunk of requests with the step's InputBatch, whose "
                "host cu_num_logits_np the specx V2 sampler reads instead of the device one"),
    # --- the specx_mtp / specx_eagle(3) drafter (a subclass of vLLM's EagleProposer) ---
    PrivateName("vllm.v1.spec_decode.eagle:EagleProposer", "hidden_states",
                "instance attribute", ("vllm_specx/glue/eagle_chain_proposer.py",
                                       "vllm_specx/glue/head_kv_holes.py"),
                "the draft's hidden-state input buffer, filled before each lookahead pass "
                "and each catch-up pass of a skipped first pass"),
    *(PrivateName("vllm.v1.spec_decode.eagle:EagleProposer", name, "instance attribute",
                  ("vllm_specx/glue/head_kv_holes.py",),
                  "a first pass whose inputs vLLM reshapes (parallel drafting, a "
                  "heterogeneous vocabulary) is never skipped: its catch-up would differ")
      for name in ("needs_extra_input_slots", "use_heterogeneous_vocab")),
    PrivateName("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "requests",
                "instance attribute", ("vllm_specx/glue/head_kv_holes.py",),
                "the runner's unfinished requests: kept first-pass inputs of the others "
                "are dropped"),
    PrivateName(_DRAFTER, "prepare_next_token_ids_padded", "attribute",
                ("vllm_specx/glue/draft_passes.py",),
                "overridden: after a step without drafts the next-token ids without the "
                "kernel (the runner calls it before propose)"),
    PrivateName("vllm.v1.worker.gpu_input_batch:InputBatch", "num_tokens_no_spec",
                "instance attribute", ("vllm_specx/glue/draft_passes.py",),
                "a discarded row's backup token sits at num_tokens_no_spec - 1 "
                "(prepare_next_token_ids_padded)"),
    PrivateName("vllm.v1.worker.gpu_input_batch:InputBatch", "num_computed_tokens_cpu",
                "instance attribute", ("vllm_specx/glue/draft_passes.py",
                                       "vllm_specx/glue/head_kv_holes.py"),
                "each request's first query position: where a skipped first pass's hole "
                "starts and where its catch-up ends"),
    PrivateName("vllm.v1.spec_decode.eagle:EagleProposer", "model_returns_tuple", "attribute",
                ("vllm_specx/glue/eagle_chain_proposer.py",),
                "whether the draft returns (LM-head input, fed-back hidden state)"),
    PrivateName("vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM",
                "combine_hidden_states", "attribute",
                ("vllm_specx/glue/eagle_chain_proposer.py",),
                "the EAGLE-3 head's fc over the target's auxiliary hidden states, applied "
                "before the first pass as vLLM's propose does"),
    # --- draft trees on the V1 runner (glue/tree_step.py) ---------------------------------
    PrivateName("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "positions",
                "instance attribute", ("vllm_specx/glue/tree_step.py",),
                "the step's positions buffer: tree nodes get ctx + depth before the target "
                "forward, chain positions again before the drafter's first pass"),
    PrivateName("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "input_ids",
                "instance attribute", ("vllm_specx/glue/tree_step.py",),
                "the step's input ids, rewritten in chain layout after verification"),
    PrivateName("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "query_start_loc",
                "instance attribute", ("vllm_specx/glue/tree_step.py",),
                "where each request's query tokens start in the step"),
    PrivateName("vllm.v1.worker.block_table:BlockTable", "slot_mapping",
                "instance attribute", ("vllm_specx/glue/tree_step.py",),
                "the step's KV slot of every query token (the compaction's sources and "
                "destinations)"),
    # --- the runner hook ------------------------------------------------------------------
    PrivateName("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "drafter",
                "instance attribute", ("vllm_specx/glue/runner_hook.py",),
                "replaced by the specx drafter right after __init__"),
    PrivateName("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "rejection_sampler",
                "instance attribute", ("vllm_specx/glue/runner_hook.py",),
                "replaced by the specx sampler right after __init__"),
    # --- the CLI patch --------------------------------------------------------------------
    PrivateName("vllm.utils.argparse_utils:FlexibleArgumentParser", "_actions",
                "instance attribute", ("vllm_specx/glue/patches.py",),
                "argparse's action list, where --spec-method's choices are widened"),
    # --- the CPU reference backend ----------------------------------------------------------
    PrivateName("vllm.triton_utils.dispatcher", "_registry", "attribute",
                ("vllm_specx/cpu_ops/kernel_overrides.py",),
                "which implementation the platform registered for a kernel"),
    PrivateName("vllm.triton_utils.dispatcher", "_kernel_arg_names", "source",
                ("vllm_specx/cpu_ops/vllm_fixes.py",),
                "cached argument names dropped from a rebound kernel wrapper"),
    PrivateName("vllm.v1.worker.block_table:ComputeSlotMappingKernel", "kernel", "attribute",
                ("vllm_specx/cpu_ops/schemas.py", "vllm_specx/cpu_ops/kernel_overrides.py"),
                "the Triton kernel whose defective CPU adapter is replaced"),
    PrivateName("vllm.v1.sample.rejection_sampler", "expand_kernel", "attribute",
                ("vllm_specx/cpu_ops/schemas.py", "vllm_specx/cpu_ops/kernel_overrides.py"),
                "the Triton kernel whose defective CPU adapter is replaced"),
    PrivateName("vllm.platforms.interface:Platform", "import_kernels", "attribute",
                ("vllm_specx/cpu_ops/__init__.py",),
                "lets a compiled CPU build load before deciding to register reference ops"),
    PrivateName("torch._C", "_dispatch_has_kernel", "attribute",
                ("vllm_specx/cpu_ops/compiled_ops.py",),
                "torch's, not vLLM's: detects a compiled _C op (hasattr is the fallback)"),
    PrivateName("torch:ops.mkldnn", "_reorder_linear_weight", "attribute",
                ("vllm_specx/cpu_ops/linear.py",),
                "torch's, not vLLM's: packs a linear weight for oneDNN once (the patch "
                "keeps vLLM's linear where it is missing)"),
    PrivateName("torch:ops.mkldnn", "_linear_pointwise", "attribute",
                ("vllm_specx/cpu_ops/linear.py",),
                "torch's, not vLLM's: oneDNN's linear on the prepacked weight"),
    PrivateName("torch:ops.mkldnn", "_is_mkldnn_bf16_supported", "attribute",
                ("vllm_specx/cpu_host.py",),
                "torch's, not vLLM's: whether oneDNN computes bfloat16 under its ISA cap "
                "(the CPU class; bfloat16 packed only where True)"),
    PrivateName("torch:cpu", "_is_amx_tile_supported", "attribute",
                ("vllm_specx/cpu_host.py", "vllm_specx/cpu_ops/vllm_fixes.py"),
                "torch's, not vLLM's: AMX tiles present (oneDNN capped; vLLM would pick "
                "AMX_MLA there)"),
    PrivateName("torch:cpu", "_is_avx512_bf16_supported", "attribute",
                ("vllm_specx/cpu_host.py",),
                "torch's, not vLLM's: AVX512-BF16 present (the CPU class)"),
    # --- the benchmark ------------------------------------------------------------------------
    PrivateName("vllm.v1.engine.core_client", "InprocClient", "attribute",
                ("vllm_specx/bench/engine_run.py",),
                "recognised by class name: the engine core runs in this process"),
    PrivateName("vllm.compilation.cuda_graph:CUDAGraphWrapper", "unwrap", "attribute",
                ("vllm_specx/bench/engine_run.py",),
                "the timers hook the module inside a CUDA-graph wrapper"),
)


def missing_private_names(vllm_version: str) -> list[str]:
    """One line per private name the installed vLLM no longer has."""
    return [m for m in (n.missing(vllm_version) for n in PRIVATE_NAMES) if m is not None]


def missing_patch_targets(vllm_version: str) -> list[str]:
    """One line per VllmPatch whose target attribute the installed vLLM lacks."""
    problems = []
    for point in patches():
        if point.vllm_attribute is None or point.scope == ASCEND:
            continue  # ascend: vLLM-Ascend's targets, checked in tests/ascend
        owner_path, _, attr = point.vllm_attribute.rpartition(".")
        if ":" not in owner_path:  # a module-level attribute: "module:attr"
            owner_path, attr = point.vllm_attribute.split(":", 1)
        try:
            owner = resolve(owner_path)
        except (ImportError, AttributeError) as exc:
            problems.append(f"vLLM {vllm_version} no longer has {owner_path}, used by patch "
                            f"{point.name} ({point.defined_in}): {type(exc).__name__}: {exc}")
            continue
        if attr not in vars(owner):
            problems.append(f"vLLM {vllm_version} no longer has {point.vllm_attribute}, "
                            f"used by patch {point.name} ({point.defined_in})")
    return problems
