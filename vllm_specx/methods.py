"""The speculative methods vllm-specx adds, and their knobs: the user interface.

Pure Python (no vLLM, no torch): the single source for a method's name, knobs
(defaults, allowed values, help text), cross-knob checks, verification rule and
proposer. Config validation, the runner hook, the sampler, the docs' defaults table
(docs/methods/knobs.md) and ``vllm-specx methods`` all read this module.

Adding a method: one :class:`MethodSpec` entry in :data:`METHODS` (naming its proposer
class with :func:`named`, so nothing here imports the glue) plus one proposer file in
``vllm_specx/glue/``; docs/contributing/adding-a-method.md walks through it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm_specx.algorithms import stop_defaults

if TYPE_CHECKING:  # methods.py must import without torch or vLLM
    from vllm_specx.backends.base import DeviceLimits


@dataclass(frozen=True)
class Knob:
    """One user-facing setting of a specx method."""

    name: str
    kind: str  # "int", "float", "bool", "str", "tree", "switch" (true, false or a word)
    default: Any
    allowed: str  # human text, used verbatim in error messages
    help: str
    check: Callable[[Any], bool] | None = None
    # Knobs only meaningful when another knob has a value (e.g. mtp's stop rule needs
    # ``adaptive: true``): (knob name, required value).
    requires: tuple[str, Any] | None = None
    # A knob that, when on (anything but false / absent), also satisfies ``requires``
    # (the EAGLE heads' ``cost_control``: with ``adaptive`` or with a ``draft_tree``).
    or_with: str | None = None
    # A vLLM SpeculativeConfig field that a specx method also takes: validated here like
    # any knob, then handed to vLLM's config unchanged (it is not a specx setting).
    vllm_field: bool = False

    def type_ok(self, value: Any) -> bool:
        # bool is a subclass of int in Python: `true` must not pass as a count.
        if self.kind == "int":
            return isinstance(value, int) and not isinstance(value, bool)
        if self.kind == "float":
            return (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(float(value))
            )
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str) and value != ""
        if self.kind == "switch":  # on, off, or a named mode (``check`` says which words)
            return isinstance(value, (bool, str))
        if self.kind == "tree":  # a draft tree: false, true or a dict of tree settings
            return isinstance(value, (bool, Mapping))
        raise AssertionError(f"unknown knob kind {self.kind}")


@dataclass(frozen=True)
class Refusal:
    """Why a validated config is refused: the key, its value and what is allowed
    (config validation turns it into the one-line error)."""

    key: str
    value: Any
    allowed: str


@dataclass(frozen=True)
class CheckContext:
    """What a cross-knob check sees: the method's settings after every knob passed its
    own check (defaults filled in), the draft model, and the device's limits."""

    spec: MethodSpec
    settings: Mapping[str, Any]
    model: str | None
    limits: DeviceLimits
    device: str


# A rule between knobs (or between a knob and the device): None when the settings pass.
CrossCheck = Callable[[CheckContext], "Refusal | None"]
# Returns the proposer class (constructed like vLLM's proposers,
# ``Class(vllm_config, device, runner)``; the runner hook then sets its ``settings``).
ProposerFactory = Callable[[], type]
# Returns a check run when the engine is configured (``EngineArgs.create_speculative_config``),
# where vLLM's model config is known: ``check(target_model_config, settings, draft_model)``
# raises ``SpecxConfigError`` in one line (e.g. specx_mtp needs a target with MTP layers; an
# EAGLE head must fit the target's hidden size and vocabulary).
EngineCheckFactory = Callable[[], Callable[[Any, Mapping[str, Any]], None]]


@dataclass(frozen=True)
class NpuRefusedSetting:
    """A setting value the method's NPU drafter does not implement (refused at start on
    Ascend, glue/ascend.py), and why."""

    knob: str
    value: Any
    why: str


@dataclass(frozen=True)
class V1OnlySetting:
    """A setting value with which a method that runs on Model Runner V2 still runs on
    V1 (named in docs/model-runners.md, and logged), and why."""

    knob: str
    value: Any
    why: str


@dataclass(frozen=True)
class MethodSpec:
    """A specx method: what it translates to in vLLM, its knobs and the rules between
    them, how it verifies and which proposer drafts for it."""

    name: str
    vllm_method: str  # the vLLM base method the engine is configured with
    summary: str
    lossless: bool
    needs_draft_model: bool
    default_num_speculative_tokens: int | None
    knobs: tuple[Knob, ...] = field(default_factory=tuple)
    # Checks run after every knob passed its own check, in order; the first refusal wins.
    checks: tuple[CrossCheck, ...] = field(default_factory=tuple)
    # The specx sampler's verification rule (a rule of vllm_specx.algorithms.verify):
    # "standard" (lossless rejection sampling) or "mtad" (joint likelihood threshold).
    rule: str = "standard"
    # None until the method's drafter ships.
    proposer: ProposerFactory | None = None
    # False until the method's proposer ships: selecting it fails at start with a
    # "not available yet in this version" error instead of silently falling back.
    available: bool = False
    # True when the proposer drafts a different number of tokens per request and hands
    # the scheduler exactly those (EMS-SD's "no padding"). vLLM's async scheduling
    # reserves K placeholder slots per request before the drafts exist, so such a method
    # runs with synchronous scheduling (config translation turns async off).
    ragged_drafts: bool = False
    # True when, at a fixed K (no ``adaptive``, no tree), the method's Model Runner V2
    # speculator is vLLM's own drafting unchanged (``glue/v2_eagle.py``): every request
    # gets K drafts, so on V2 such a config is not ragged and keeps vLLM's async
    # scheduling (:func:`drafts_ragged`). On V1 the specx chain proposer drafts even at a
    # fixed K, and scheduling stays synchronous there.
    v2_fixed_k_is_vllms: bool = False
    # The proposer vLLM-Ascend's NPU runner builds for this method (a subclass of
    # vLLM-Ascend's proposer base, driven through its ``_propose``), imported lazily.
    # None: the drafter cannot run on Ascend NPUs yet, and the method is refused at start
    # there (vllm_specx/glue/ascend.py; docs/ascend.md).
    npu_proposer: ProposerFactory | None = None
    # Settings the NPU drafter does not implement: refused on Ascend in one line.
    npu_refused_settings: tuple[NpuRefusedSetting, ...] = ()
    # Checks that need vLLM's model config, run when the engine is configured (named
    # with :func:`named`: they live in the glue).
    engine_checks: tuple[EngineCheckFactory, ...] = ()
    # Beam drafters: the knob holding the beam width B. The drafter keeps B tails of up
    # to K tokens per request, so B * K is capped by the device's ``max_beam_positions``
    # (:func:`beam_positions_fit_device`), and the engine reserves KV scratch blocks for
    # the B - 1 beams beyond a request's own slots (glue/beam_kv.py).
    beam_width_knob: str | None = None
    # vLLM's own method name that, given one of this method's knobs, is read as this
    # method (``{"method": "mtp", "adaptive": true}`` is ``specx_mtp``): without the
    # plugin that dict would be an error, and without such a knob vLLM's method is
    # untouched.
    vllm_alias: str | None = None
    # Model Runner V2 (vLLM's default since 0.29; V1 is deprecated upstream): True once
    # the method's V2 speculator and the specx sampler on V2 pass the V2 tests
    # (tests/v2). While False, ``specx_selects_v1_runner`` (glue/patches.py) adds the
    # method to vLLM's list of features V2 does not support, so vLLM picks V1 and logs
    # ``v1_reason``, and forcing V2 is refused at start with it.
    runs_on_v2: bool = False
    # The method's Model Runner V2 speculator class (a ``BaseSpeculator`` built as
    # ``Class(vllm_config, device, runner)``; ``glue/v2_patches.install_v2_speculator``
    # swaps it in for vLLM's), imported lazily. None: no V2 speculator yet.
    v2_speculator: ProposerFactory | None = None
    # One line: why the method still needs the V1 runner (logged, and named in the
    # docs/model-runners.md). Ignored when ``runs_on_v2``.
    v1_reason: str = "its drafter and sampler are hooked into the V1 runner only"
    # Settings that keep a method which runs on V2 on the V1 runner all the same (e.g.
    # an adaptive stop whose V2 drafter is not built yet): :func:`v1_only_reason`.
    v1_only_settings: tuple[V1OnlySetting, ...] = ()
    # CUDA graphs on V2, declared before start (logged by config translation):
    # "captured" -- the speculator takes part in V2's graph capture (vLLM's own
    # speculator drafts); "eager" -- the specx speculator's draft passes run eager
    # (their batch changes shape within a round), while V2 captures the target model
    # as usual. The specx sampler runs outside graphs, as V2's own sampler does.
    v2_cudagraph: str = "eager"

    def knob(self, name: str) -> Knob | None:
        return next((k for k in self.knobs if k.name == name), None)

    def v1_only_reason(self, settings: Mapping[str, Any]) -> str | None:
        """Why these settings need the V1 runner, or None when they run on V2."""
        if not self.runs_on_v2:
            return self.v1_reason
        for setting in self.v1_only_settings:
            value = settings.get(setting.knob)
            # ``True`` stands for "on": a tree knob is on as a dict too.
            if value == setting.value or (setting.value is True and value not in (None, False)):
                return f"{setting.knob} = {str(setting.value).lower()}: {setting.why}"
        return None


def _int_at_least(lo: int) -> Callable[[Any], bool]:
    return lambda v: v >= lo


def _open_unit(v: float) -> bool:
    return 0.0 < v < 1.0


def _half_open_unit(v: float) -> bool:
    return 0.0 < v <= 1.0


# Defaults picked from the MTAD sweep of docs/benchmarks/mtad.md (fixture pair, T=1, top-k 20,
# top-p 0.9):
# B = 2 gives most of the perplexity drop of wider beams at a quarter of B = 8's draft
# passes; tau = 0.1 (the paper's) accepts nearly as much as 0.05.
NUM_BEAMS = Knob(
    "num_beams", "int", 4, "an integer >= 1",
    "beam width B of the draft beam search (B = 1 is greedy/sampled chain drafting)",
    _int_at_least(1),
)
GREEDY_DRAFTING = Knob(
    "greedy_drafting", "str", "chain", '"beam" or "chain"',
    "how greedy requests draft: the B-wide beam search's joint-best beam, or the argmax "
    "chain (width 1; accepted more often at temperature 0, see docs/benchmarks/mtad.md)",
    lambda v: v in ("beam", "chain"),
)
ACCEPTANCE_THRESHOLD = Knob(
    "acceptance_threshold", "float", 0.1, "a number in (0, 1]",
    "MTAD's tau: depth i is accepted when the joint target/draft likelihood ratio of the "
    "first i tokens exceeds tau; smaller accepts more, 1 approaches plain sampling",
    _half_open_unit,
)
MIN_SPECULATIVE_TOKENS = Knob(
    "min_speculative_tokens", "int", stop_defaults.MIN_TOKENS,
    "an integer >= 1 and <= num_speculative_tokens",
    "never stop a draft before this many tokens",
    _int_at_least(1),
)
STOP_THRESHOLD = Knob(
    "stop_threshold", "float", stop_defaults.STOP_THRESHOLD, "a number in (0, 1)",
    "SpecDec++'s h: stop drafting once the predicted probability that some draft token "
    "so far is rejected exceeds h",
    _open_unit,
)
ACCEPTANCE_HEAD = Knob(
    "acceptance_head", "str", None, "a local directory or a hub id",
    "trained acceptance-prediction head; without it the training-free confidence policy "
    "is used",
)
CONFIDENCE_THRESHOLD = Knob(
    "confidence_threshold", "float", stop_defaults.CONFIDENCE_THRESHOLD, "a number in (0, 1)",
    "training-free policy: stop when the draft's own probability of its token falls "
    "under this",
    _open_unit,
)
CONFIDENCE_SIGNAL = Knob(
    "confidence_signal", "str", stop_defaults.CONFIDENCE_SIGNAL,
    '"token_prob", "max_prob" or "top2_margin"',
    "training-free policy: which confidence of the draft is compared with "
    "confidence_threshold: the probability of the drafted token, the draft's largest "
    "probability, or the gap between its two largest",
    lambda v: v in stop_defaults.CONFIDENCE_SIGNALS,
)
DRAFT_SAMPLING = Knob(
    "draft_sampling", "str", "sampled", '"sampled" or "greedy"',
    "how sampled requests draft: from the draft's warped distribution q (speculative "
    "sampling), or its argmax (one-hot q); greedy requests always draft the argmax",
    lambda v: v in ("sampled", "greedy"),
)
COST_CONTROL = Knob(
    "cost_control", "bool", True, "true or false",
    "choose every step's draft lengths from the engine's own measured step costs and each "
    "request's acceptance so far (0 where drafting would not pay); false: the stop rule "
    "alone decides. With a dynamic draft_tree it keeps per request only the tree nodes "
    "that pay at those costs, down to none (a plain step), and adaptive's i.i.d. children "
    "of a sampled batch to a depth chosen from them before drafting (0: a plain step), "
    "verified whole; false verifies every drafted tree whole",
)
# mtad's depth control (issue 32): every request's own depth 0..K per step
# (``CostControl.plan_depths``). On by default for every request: a user turns mtad on once
# for all their traffic, and at T = 1 drafting K every step ran at 0.25-0.79x of no
# speculation on the real pair (batch 32 to 1) where the control ran at 0.92-1.05x
# (docs/cost-control.md, "mtad: per-request depth"). A sampled request's output depends on
# how much mtad drafts (its rule is not lossless by design; a depth-0 step samples the
# target as no speculation does), so "greedy" keeps mtad's rule at full depth for every
# sampled request and weighs only all-greedy batches (output unchanged, only speed).
MTAD_COST_CONTROL = Knob(
    "cost_control", "switch", True, 'true, false or "greedy"',
    "choose every step's beam depth per request (0..num_speculative_tokens; a request "
    "leaves the draft passes at its own depth) from the engine's own measured step costs "
    "and each request's acceptance so far; all 0 is a plain decode step that skips the "
    "draft model. true (the default): every step, sampled requests too (a sampled "
    "request's output depends on how much mtad drafts; at depth 0 it is sampled from the "
    "target as without speculation). \"greedy\": only on steps whose requests are all "
    "greedy (temperature 0: output unchanged, only speed); a step with a sampled request "
    "drafts num_speculative_tokens for every request, mtad's rule at full depth. false: "
    "never. With draft_tree: the tree's depth per step (0..num_speculative_tokens, one for "
    "the batch) and then per request only the beam tree's nodes that pay, down to none (as "
    "adaptive's draft-model tree). Either model runner",
    lambda v: v in (True, False, "greedy"),
)
HETEROGENEOUS_VOCAB = Knob(
    "use_heterogeneous_vocab", "bool", False, "true or false",
    "vLLM's setting for a draft with another tokenizer: drafts stay inside the shared "
    "vocabulary and token ids are translated both ways",
    vllm_field=True,
)
# specx_mtp's own default: an MTP layer is distilled from the target, so its probabilities
# are as flat as the target's, and at temperature 0 a flat argmax is still usually right.
# On the MTP fixture (docs/methods/specx-mtp.md) 0.5 stopped nearly every draft after one
# token (projected 1.39x at K = 8 vs 1.98x at 0.2, T = 0); at T = 1 0.2 and 0.5 projected the
# same.
MTP_CONFIDENCE_THRESHOLD = replace(
    CONFIDENCE_THRESHOLD, default=0.2,
    help="training-free policy: stop when the MTP layer's own probability of its draft "
    "falls under this (lower than adaptive's: an MTP layer's probabilities are as flat as "
    "the target's)",
)
MTP_ADAPTIVE = Knob(
    "adaptive", "bool", False, "true or false",
    "stop MTP drafting per request with the adaptive stop rule",
)
EAGLE_ADAPTIVE = Knob(
    "adaptive", "bool", False, "true or false",
    "stop the EAGLE head's drafting per request with the adaptive stop rule",
)
EAGLE_CONFIDENCE_THRESHOLD = replace(
    CONFIDENCE_THRESHOLD,
    help="training-free policy: stop when the EAGLE head's own probability of its draft "
    "falls under this",
)


# Draft trees (issue 37). mtad's tree is its B beams of depth K, verified in one target
# pass; vLLM's num_speculative_tokens is then the tree's node budget (the scheduler sees
# every node as a draft), while the specx setting keeps the beam depth K.
MAX_TREE_NODES = 64  # as vllm_specx.algorithms.draft_tree.MAX_TREE_NODES (no torch here)
MTAD_DRAFT_TREE = Knob(
    "draft_tree", "tree", False, 'false, true or {"max_nodes": N} (N from 1 to 64)',
    "verify all num_beams beams at once as one draft tree (one target pass, ancestor-only "
    "attention; CPU, V1 or V2 runner) instead of the single best beam; true keeps every "
    "beam (up to num_beams * K nodes), {\"max_nodes\": N} the N nodes of highest joint draft "
    "probability",
)


ADAPTIVE_DRAFT_TREE = Knob(
    "draft_tree", "tree", False,
    'false, true or {"max_nodes": N, "max_depth": D, "branching": K, "sampled_children": '
    'S} (N 1-64, D 1-16, K 1-N, S true or false)',
    "draft a dynamic tree with the draft model instead of the adaptive chain, verified "
    "losslessly in one target pass (CPU, V1 or V2 runner); greedy requests: per depth the "
    "best `branching` continuations of the tree's best paths, the best `max_nodes` nodes "
    "kept; sampled requests (sampled_children, default true; V1 or V2 runner): `branching` "
    "i.i.d. draws per depth from the drafter, the likeliest one "
    "expanded, verified by SpecInfer's multi-draft rule (false: the greedy requests' top-k "
    "tree, verified by the deterministic rule); the "
    "adaptive stop is not used then; true = the defaults 16 / 5 / 4 / true",
)
DEFAULT_TREE = {"max_nodes": 16, "max_depth": 5, "branching": 4}  # draft_tree.DEFAULT_TREE_KNOB
# A draft-model tree's children for sampled requests: i.i.d. draws verified by the
# "sampled" (SpecInfer) rule, or the top-k tree verified by "deterministic" (docs/trees.md:
# at T = 1 the top-k tree accepts a child with p(x), below the chain's min(1, p/q)).
SAMPLED_CHILDREN_KEY = "sampled_children"


# EAGLE heads (specx_eagle, specx_eagle3) and the target's MTP layer (specx_mtp) draft
# trees with the draft's own top-k: a dynamic EAGLE-2 tree or a static tree of child-rank
# paths, by one round over vLLM's EagleProposer (glue/eagle_tree_proposer.py).
HEAD_TREE_METHODS: tuple[str, ...] = ("specx_eagle", "specx_eagle3", "specx_mtp")
HEAD_DRAFT_TREE = Knob(
    "draft_tree", "tree", False,
    'false, true, {"max_nodes": N, "max_depth": D, "branching": K} (N 1-64, D 1-16, K 1-N, '
    '(D - 1) * K <= 64) or {"paths": [[0], [1], [0, 0], ...]} (at most 64 nodes, 16 deep)',
    "draft a tree with the head instead of a chain, verified losslessly in one target pass "
    "(CPU, V1 or V2 runner): a dynamic EAGLE-2 tree (per depth the top `branching` children of "
    "the `branching` likeliest nodes, one head pass per depth, the best `max_nodes` nodes "
    "by joint draft probability kept) or a static tree of child-rank paths (vLLM's old "
    "speculative_token_tree format); not with adaptive; true = 16 / 5 / 4",
)

# specx_mtp's tree: the same round and shapes, drafted by the MTP layer (reused at every
# depth, as vLLM's EagleProposer reuses it for K > 1).
MTP_DRAFT_TREE = replace(
    HEAD_DRAFT_TREE,
    help="draft a tree with the MTP layer instead of a chain, verified losslessly in one "
    "target pass (CPU, V1 or V2 runner; the target's attention must take the tree mask: an "
    "MLA target runs as plain attention with VLLM_MLA_DISABLE=1): a dynamic EAGLE-2 tree (per "
    "depth the top `branching` children of the `branching` likeliest nodes, one MTP pass per "
    "depth, the best `max_nodes` nodes by joint draft probability kept) or a static tree of "
    "child-rank paths (vLLM's old speculative_token_tree format); not with adaptive; true = "
    "16 / 5 / 4",
)
# What kept specx_mtp's tree on V1 until its V2 round (glue/v2_eagle.py's
# MtpChainV2Speculator: the heads' tree round over vLLM's V2 MTPSpeculator) passed
# tests/v2; (MTP_TREE_NEEDS_V1,) in V2_MTP_TREE puts it back on V1.
MTP_TREE_NEEDS_V1 = V1OnlySetting(
    "draft_tree", True,
    "specx_mtp's tree is drafted by the V1 drafter (glue/eagle_tree_proposer.py over "
    "glue/mtp_proposer.py); its Model Runner V2 speculator drafts chains only",
)
V2_MTP_TREE: tuple[V1OnlySetting, ...] = ()

HEAD_TREE_NEEDS_V1 = V1OnlySetting(
    "draft_tree", True,
    "an EAGLE head's tree is drafted by the V1 drafter (glue/eagle_tree_proposer.py) and "
    "verified with the ancestor-only mask of vllm-specx's CPU attention (Model Runner V2, "
    "CUDA and Ascend: next issue)",
)
# What keeps an EAGLE head's tree on V1: nothing since its V2 round (glue/v2_eagle.py over
# glue/v2_tree_step.py) passed tests/v2; (HEAD_TREE_NEEDS_V1,) puts it back on V1.
V2_HEAD_TREE: tuple[V1OnlySetting, ...] = ()


def head_tree(settings: Mapping[str, Any]) -> dict[str, Any] | None:
    """An EAGLE head's or MTP layer's tree (``specx_eagle`` / ``specx_eagle3`` /
    ``specx_mtp`` with ``draft_tree``):
    ``{"paths": [...]}`` for a static tree, else the dynamic shape (max_nodes, max_depth,
    branching; defaults as ``adaptive``'s); None without one."""
    tree = settings.get("draft_tree")
    if tree in (None, False) or settings.get("method") not in HEAD_TREE_METHODS:
        return None
    if isinstance(tree, Mapping) and "paths" in tree:
        return {"paths": [list(p) for p in tree["paths"]]}
    return draft_model_tree({**settings, "method": "adaptive"})


def head_tree_fed_nodes(shape: Mapping[str, Any]) -> int:
    """The most tree nodes the head is fed in one round: a dynamic tree feeds its
    ``branching``-wide frontier at every depth but the last; a static tree its inner
    nodes (at most all but one)."""
    if "paths" in shape:
        paths = {tuple(p) for p in shape["paths"]}
        return len({p[:-1] for p in paths if len(p) > 1})
    return (int(shape["max_depth"]) - 1) * int(shape["branching"])


def head_tree_budget(shape: Mapping[str, Any]) -> int:
    """vLLM's ``num_speculative_tokens`` for an EAGLE head's tree: its node budget, and
    at least one more than the nodes fed to the head (the head writes their KV at the
    lookahead slots ``P+1 ..``, which vLLM reserves for ``num_speculative_tokens - 1``
    lookahead passes)."""
    if "paths" in shape:
        nodes = len({tuple(p) for p in shape["paths"]})
    else:
        nodes = int(shape["max_nodes"])
    return max(nodes, head_tree_fed_nodes(shape) + 1)


def draft_model_tree(settings: Mapping[str, Any]) -> dict[str, int] | None:
    """``adaptive``'s tree shape (max_nodes, max_depth, branching, sampled_children), or
    None without one."""
    tree = settings.get("draft_tree")
    if tree in (None, False) or settings.get("method") in ("mtad", *HEAD_TREE_METHODS):
        return None
    given = dict(tree) if isinstance(tree, Mapping) else {}
    given[SAMPLED_CHILDREN_KEY] = bool(given.get(SAMPLED_CHILDREN_KEY, True))
    n = given.get("max_nodes")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
        # A default never exceeds the nodes given: {"max_nodes": 2} is a 2-node tree
        # (as draft_tree.validate_tree_knob reads it), not a refused depth of 5.
        return {"max_nodes": n, **{k: min(v, n) for k, v in DEFAULT_TREE.items()
                                    if k != "max_nodes"}, **given}
    return {**DEFAULT_TREE, **given}


def tree_on(settings: Mapping[str, Any]) -> bool:
    """Whether the settings turn draft trees on."""
    return settings.get("draft_tree") not in (None, False)


def drafts_ragged(settings: Mapping[str, Any], on_v2: bool = False) -> bool:
    """Whether the method's drafter, with these settings, may hand the scheduler fewer
    drafts than K for a request (then scheduling must be synchronous: the scheduler must
    see a step's real lengths before it schedules the next). ``mtad`` drafts K unless its
    depth control is on (``true``, its default, or ``"greedy"``: a depth 0..K per
    request and step); on Model Runner V2 (``on_v2``) a head method at a fixed K drafts with
    vLLM's own speculator (``MethodSpec.v2_fixed_k_is_vllms``), K for every request."""
    spec = METHODS.get(settings.get("method", ""))
    if tree_on(settings):
        return True
    if spec is not None and on_v2 and spec.v2_fixed_k_is_vllms and not settings.get("adaptive"):
        return False
    return bool(
        (spec is not None and spec.ragged_drafts)
        or (settings.get("method") == "mtad" and settings.get("cost_control")))


def tree_max_nodes(settings: Mapping[str, Any]) -> int | None:
    """The most tree nodes a request drafts per round (None: no tree): what vLLM's
    ``num_speculative_tokens`` becomes, so the scheduler, the KV-slot allocation and the
    spec-decode counters take a whole tree."""
    tree = settings.get("draft_tree")
    if tree in (None, False):
        return None
    head = head_tree(settings)
    if head is not None:
        return head_tree_budget(head)
    shape = draft_model_tree(settings)
    if shape is not None:
        return min(shape["max_nodes"], shape["branching"] * shape["max_depth"])
    k, beams = int(settings["num_speculative_tokens"]), int(settings.get("num_beams", 1))
    if isinstance(tree, Mapping) and "max_nodes" in tree:
        return min(int(tree["max_nodes"]), beams * k)
    return beams * k


def tree_device_refusal(ctx: CheckContext, shown: Any) -> Refusal | None:
    """A draft tree on a device that cannot verify one yet, refused with that device
    backend's own reason (``DeviceLimits.reason_no_draft_tree``: on Ascend the attention
    gets no tree mask and tree size + 1 <= 16); None on CPU and CUDA (either runner since
    issue 34)."""
    reason = ctx.limits.reason_no_draft_tree
    if not reason:
        return None
    return Refusal("draft_tree", shown, f"not on {ctx.device} yet: " + reason)


def mtad_tree_fits(ctx: CheckContext) -> Refusal | None:
    """``draft_tree`` on mtad: its shape (the beams decide depth and branching), the node
    budget, and the device (CPU only for now)."""
    tree = ctx.settings.get("draft_tree")
    if tree in (None, False):
        return None
    shape = ('true, false or {"max_nodes": N}: mtad\'s tree is its beams (depth '
             "num_speculative_tokens, branching num_beams)")
    capped = isinstance(tree, Mapping) and "max_nodes" in tree  # {} is true: every beam
    if isinstance(tree, Mapping):
        if set(tree) - {"max_nodes"}:
            return Refusal("draft_tree", dict(tree), shape)
        n = tree.get("max_nodes")
        if capped and (isinstance(n, bool) or not isinstance(n, int)
                       or not 1 <= n <= MAX_TREE_NODES):
            return Refusal("draft_tree", dict(tree),
                           f'"max_nodes" must be an integer from 1 to {MAX_TREE_NODES}')
    if not capped and (nodes := tree_max_nodes(ctx.settings) or 0) > MAX_TREE_NODES:
        return Refusal("draft_tree", tree if isinstance(tree, bool) else dict(tree),
                       f"num_beams * num_speculative_tokens = {nodes} tree nodes exceed "
                       f"{MAX_TREE_NODES}; give {{\"max_nodes\": N}} with N <= {MAX_TREE_NODES}")
    return tree_device_refusal(ctx, tree if isinstance(tree, bool) else dict(tree))


def head_tree_fits(ctx: CheckContext) -> Refusal | None:
    """``draft_tree`` on an EAGLE head: ``validate_tree_knob``'s rules, not with the
    adaptive stop, the head's fed nodes within the tree limit, and the device (CPU only)."""
    tree = ctx.settings.get("draft_tree")
    if tree in (None, False):
        return None
    shown = tree if isinstance(tree, bool) else dict(tree)
    if ctx.settings.get("adaptive"):
        return Refusal("draft_tree", shown, 'not with "adaptive": true (a tree is drafted '
                       "to its shape, the adaptive stop drafts chains); drop one of them")
    if isinstance(tree, Mapping):
        from vllm_specx.algorithms.draft_tree import validate_tree_knob  # torch, lazily

        problems = validate_tree_knob(dict(tree))
        if problems:
            return Refusal("draft_tree", shown, problems[0])
    shape = head_tree(ctx.settings)
    assert shape is not None
    fed = head_tree_fed_nodes(shape)
    if fed > MAX_TREE_NODES:
        return Refusal("draft_tree", shown,
                       f'("max_depth" - 1) * "branching" = {fed} frontier nodes fed to the '
                       f"head exceed {MAX_TREE_NODES}; use a shallower or narrower tree")
    return tree_device_refusal(ctx, shown)


def draft_model_tree_fits(ctx: CheckContext) -> Refusal | None:
    """``draft_tree`` on a draft-model method: ``validate_tree_knob``'s rules (dynamic
    trees only: static ``paths`` need a top-k drafter) and the device (CPU only)."""
    tree = ctx.settings.get("draft_tree")
    if tree in (None, False):
        return None
    shown = tree if isinstance(tree, bool) else dict(tree)
    if isinstance(tree, Mapping):
        if "paths" in tree:
            return Refusal("draft_tree", shown, 'a dynamic tree {"max_nodes": N, "max_depth": '
                           'D, "branching": K}: static "paths" trees are not drafted by a '
                           "draft model yet")
        from vllm_specx.algorithms.draft_tree import validate_tree_knob  # torch, lazily

        sampled = tree.get(SAMPLED_CHILDREN_KEY, True)
        if not isinstance(sampled, bool):
            return Refusal("draft_tree", shown, f'"{SAMPLED_CHILDREN_KEY}" must be true or '
                           "false (i.i.d. draws verified by the sampled rule for sampled "
                           "requests, or the top-k tree)")
        problems = validate_tree_knob({k: v for k, v in tree.items()
                                       if k != SAMPLED_CHILDREN_KEY})
        if problems:
            return Refusal("draft_tree", shown, problems[0])
    shape = draft_model_tree(ctx.settings)
    positions = shape["branching"] * shape["max_depth"] if shape is not None else 0
    if positions > ctx.limits.max_beam_positions:
        # The tree is drafted by the MTAD round's beams (branching beams, max_depth deep):
        # the same device limit as mtad's num_beams * num_speculative_tokens.
        return Refusal("draft_tree", shown,
                       f'"branching" * "max_depth" = {positions} exceeds '
                       f"{ctx.limits.max_beam_positions} on {ctx.device} "
                       f"({ctx.limits.reason_max_beam_positions})")
    return tree_device_refusal(ctx, shown)


# -- cross-knob checks ------------------------------------------------------------------
def beam_positions_fit_device(ctx: CheckContext) -> Refusal | None:
    """B * K (B: the spec's ``beam_width_knob``): the beam drafter keeps that many tail
    tokens per request, capped by the device's ``max_beam_positions``."""
    width_knob = ctx.spec.beam_width_knob
    if width_knob is None:
        return None
    k, beams = ctx.settings["num_speculative_tokens"], ctx.settings[width_knob]
    if k is None or beams * k <= ctx.limits.max_beam_positions:
        return None
    return Refusal(
        width_knob, beams,
        f"{width_knob} * num_speculative_tokens = {beams * k} exceeds "
        f"{ctx.limits.max_beam_positions} on {ctx.device} "
        f"({ctx.limits.reason_max_beam_positions})",
    )


def min_tokens_within_k(ctx: CheckContext) -> Refusal | None:
    """min_speculative_tokens <= K, when the stop rule that reads it is on."""
    min_k, k = ctx.settings["min_speculative_tokens"], ctx.settings["num_speculative_tokens"]
    requires = ctx.spec.knob("min_speculative_tokens").requires
    if requires is not None and ctx.settings.get(requires[0]) != requires[1]:
        return None  # the knob is inert (e.g. specx_mtp without adaptive)
    if k is None or min_k <= k:
        return None
    return Refusal("min_speculative_tokens", min_k, f"at most num_speculative_tokens ({k})")


def acceptance_head_fits_draft(ctx: CheckContext) -> Refusal | None:
    """A local acceptance head must exist and fit the draft model's hidden size."""
    head = ctx.settings["acceptance_head"]
    if head is None:
        return None
    from vllm_specx.acceptance_head_files import acceptance_head_problem  # reads files

    problem = acceptance_head_problem(head, draft_model=ctx.model)
    return None if problem is None else Refusal("acceptance_head", head, problem)


# -- names of glue code (imported on first use: this module imports no vLLM, no torch) -----
def named(target: str) -> Callable[[], Any]:
    """``"package.module:attribute"`` as a zero-argument callable that imports the module
    and returns the attribute: how the registry names a proposer class (or a glue
    function) without importing vLLM or torch, or the glue importing this module back."""
    module, _, attribute = target.partition(":")

    def load() -> Any:
        return getattr(importlib.import_module(module), attribute)

    load.__qualname__ = load.__name__ = f"named({target!r})"
    return load


def _requires_adaptive(knob: Knob, or_with: str | None = None) -> Knob:
    # The adaptive-stop knobs, as mtp takes them: only with `adaptive: true` (or with
    # `or_with` on).
    return Knob(
        knob.name, knob.kind, knob.default, knob.allowed, knob.help, knob.check,
        requires=("adaptive", True), or_with=or_with,
    )


ADAPTIVE_STOP_NEEDS_V1 = V1OnlySetting(
    "adaptive", True,
    "the adaptive stop over MTP layers and EAGLE heads runs in the V1 chain drafter "
    "(glue/eagle_chain_proposer.py); on V2 these methods draft a fixed K",
)
# What keeps the EAGLE / MTP family's adaptive stop on V1: nothing since its V2 round
# (glue/v2_eagle.py) passed tests/v2; (ADAPTIVE_STOP_NEEDS_V1,) puts it back on V1.
V2_ADAPTIVE_STOP: tuple[V1OnlySetting, ...] = ()


def _eagle_head_spec(name: str, vllm_method: str, what: str, runs_on_v2: bool) -> MethodSpec:
    """``specx_eagle`` / ``specx_eagle3``: vLLM's EAGLE drafting over a head (``model``),
    verified by the specx sampler, optionally with the adaptive stop; one proposer for
    both (and for ``specx_mtp``): the chain drafter over vLLM's ``EagleProposer``."""
    return MethodSpec(
        name=name,
        vllm_method=vllm_method,
        summary=f"{what} over the target's hidden states (vLLM's '{vllm_method}'), "
        "verified by the specx sampler, optionally with the adaptive stop",
        lossless=True,
        needs_draft_model=True,
        default_num_speculative_tokens=8,  # adaptive's: the stop picks each length
        knobs=(
            EAGLE_ADAPTIVE,
            *(_requires_adaptive(k) for k in (
                MIN_SPECULATIVE_TOKENS, STOP_THRESHOLD, ACCEPTANCE_HEAD,
                EAGLE_CONFIDENCE_THRESHOLD,
            )),
            # Prunes a dynamic draft_tree's nodes too (glue/tree_cost.py); with a tree it
            # is on only when given (translate: trees default to false).
            _requires_adaptive(COST_CONTROL, or_with="draft_tree"),
            HEAD_DRAFT_TREE,
        ),
        checks=(min_tokens_within_k, acceptance_head_fits_draft, head_tree_fits),
        proposer=named("vllm_specx.glue.eagle_chain_proposer:EagleChainProposer"),
        available=True,
        ragged_drafts=True,  # the adaptive stop drafts per-request lengths
        v2_fixed_k_is_vllms=True,
        engine_checks=(named("vllm_specx.glue.patches:require_eagle_head_fits_target"),),
        vllm_alias=vllm_method,
        # On V2: vLLM's own V2 EagleSpeculator at a fixed K (the argmax chain the V1 chain
        # drafter runs at fixed K); with adaptive: true the chain round over it
        # (glue/v2_eagle.py), with draft_tree the head-tree round over V2's tree step.
        # The specx sampler verifies.
        runs_on_v2=runs_on_v2,
        v2_speculator=named("vllm_specx.glue.v2_eagle:EagleChainV2Speculator"),
        v1_reason="not run on Model Runner V2 yet: there is no EAGLE (one-layer) test head",
        v1_only_settings=(*V2_ADAPTIVE_STOP, *V2_HEAD_TREE),
        v2_cudagraph="captured",
    )


METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec(
            name="mtad",
            vllm_method="draft_model",
            summary="beam-search drafting with a small model, verified by joint likelihood "
            "(MTAD); not distribution-preserving by design",
            lossless=False,
            needs_draft_model=True,
            default_num_speculative_tokens=4,
            knobs=(NUM_BEAMS, ACCEPTANCE_THRESHOLD, GREEDY_DRAFTING, HETEROGENEOUS_VOCAB,
                   MTAD_DRAFT_TREE, MTAD_COST_CONTROL),
            checks=(beam_positions_fit_device, mtad_tree_fits),
            rule="mtad",
            proposer=named("vllm_specx.glue.mtad_proposer:MTADProposer"),
            v2_speculator=named("vllm_specx.glue.v2_speculators:MTADV2Speculator"),
            runs_on_v2=True,
            available=True,
            beam_width_knob="num_beams",
            # "cost_control": true runs on V1 and V2 alike: both plan the step's depth
            # before the first pass (SpecxPasses.propose, MTADV2Speculator) and hand a
            # shallower round to the scheduler as ragged drafts (drafts_ragged).
        ),
        MethodSpec(
            name="adaptive",
            vllm_method="draft_model",
            summary="draft model that stops each request's draft early when a rejection is "
            "predicted (SpecDec++), verified by standard rejection sampling",
            lossless=True,
            needs_draft_model=True,
            default_num_speculative_tokens=8,
            knobs=(MIN_SPECULATIVE_TOKENS, STOP_THRESHOLD, ACCEPTANCE_HEAD, CONFIDENCE_THRESHOLD,
                   CONFIDENCE_SIGNAL, DRAFT_SAMPLING, COST_CONTROL, ADAPTIVE_DRAFT_TREE),
            checks=(min_tokens_within_k, acceptance_head_fits_draft, draft_model_tree_fits),
            proposer=named("vllm_specx.glue.adaptive_proposer:AdaptiveProposer"),
            v2_speculator=named("vllm_specx.glue.v2_speculators:AdaptiveV2Speculator"),
            runs_on_v2=True,
            available=True,
            ragged_drafts=True,
        ),
        MethodSpec(
            name="specx_mtp",
            vllm_method="mtp",
            summary="the target's own multi-token-prediction layers, verified by the specx "
            "sampler, optionally with the adaptive stop",
            lossless=True,
            needs_draft_model=False,
            default_num_speculative_tokens=None,  # vLLM reads it from the MTP config
            knobs=(
                MTP_ADAPTIVE,
                *(_requires_adaptive(k) for k in (
                    MIN_SPECULATIVE_TOKENS, STOP_THRESHOLD, ACCEPTANCE_HEAD,
                    MTP_CONFIDENCE_THRESHOLD,
                )),
                # Prunes a dynamic draft_tree's nodes too, as on the EAGLE heads.
                _requires_adaptive(COST_CONTROL, or_with="draft_tree"),
                MTP_DRAFT_TREE,
            ),
            checks=(min_tokens_within_k, acceptance_head_fits_draft, head_tree_fits),
            proposer=named("vllm_specx.glue.mtp_proposer:MtpProposer"),
            available=True,
            ragged_drafts=True,  # the adaptive stop drafts per-request lengths
            v2_fixed_k_is_vllms=True,
            # vLLM-Ascend's own MTP proposer (greedy MTP drafts, one-hot q), verified by
            # the specx sampler; the adaptive stop is refused on NPU.
            npu_proposer=named("vllm_ascend.spec_decode.eagle_proposer:AscendEagleProposer"),
            npu_refused_settings=(
                NpuRefusedSetting(
                    "adaptive", True,
                    "on NPU specx_mtp drafts with vLLM-Ascend's own MTP proposer, which "
                    "drafts a fixed K; the adaptive stop runs only inside the specx GPU "
                    "drafter loop",
                ),
            ),
            engine_checks=(named("vllm_specx.glue.patches:require_mtp_layers"),
                           named("vllm_specx.glue.mtp_proposer:require_tree_target")),
            vllm_alias="mtp",
            # As the EAGLE heads: vLLM's own V2 MTP speculator at a fixed K, the chain
            # round over it with adaptive: true, the head-tree round with draft_tree
            # (glue/v2_eagle.py; an MLA target's tree is refused on either runner).
            runs_on_v2=True,
            v2_speculator=named("vllm_specx.glue.v2_eagle:MtpChainV2Speculator"),
            v1_only_settings=(*V2_ADAPTIVE_STOP, *V2_MTP_TREE),
            v2_cudagraph="captured",
        ),
        _eagle_head_spec("specx_eagle", "eagle", "an EAGLE head (one decoder layer)",
                         runs_on_v2=False),
        _eagle_head_spec("specx_eagle3", "eagle3",
                         "an EAGLE-3 head (one decoder layer over three target layers)",
                         runs_on_v2=True),
    )
}

# vLLM's own `mtp`, `eagle` and `eagle3` keep their names and meanings. The specx
# methods over them are `specx_mtp`, `specx_eagle`, `specx_eagle3`; vLLM's name plus a knob
# only specx has (`{"method": "eagle3", "adaptive": true}`) is read as the specx method too,
# because without the plugin that dict would be an error: vLLM method -> (specx method,
# the knobs that select it).
VLLM_ALIASES: dict[str, tuple[str, frozenset[str]]] = {
    spec.vllm_alias: (spec.name, frozenset(k.name for k in spec.knobs if not k.vllm_field))
    for spec in METHODS.values() if spec.vllm_alias is not None
}
MTP_ALIAS_TRIGGERS = VLLM_ALIASES["mtp"][1]

COMMON_KNOBS: tuple[str, ...] = ("method", "model", "num_speculative_tokens")

# vLLM SpeculativeConfig fields a specx method passes through unchanged.
PASSTHROUGH_VLLM_KEYS: frozenset[str] = frozenset(
    {
        "draft_tensor_parallel_size",
        "quantization",
        "max_model_len",
        "revision",
        "code_revision",
        "draft_load_config",
        "enforce_eager",
    }
)

# vLLM keys that do something a specx method replaces: refused with the reason.
CONFLICTING_VLLM_KEYS: dict[str, str] = {
    "rejection_sample_method": "specx methods verify with the specx sampler",
    "draft_sample_method": "specx methods sample drafts with their own rule",
    "synthetic_acceptance_rates": "specx methods verify with the specx sampler",
    "prompt_lookup_max": "it belongs to vLLM's ngram method",
    "prompt_lookup_min": "it belongs to vLLM's ngram method",
    "parallel_drafting": "specx drafters draft sequentially",
    # Taken by mtad (a knob there); the unshipped drafters have no vocabulary mapping yet.
    "use_heterogeneous_vocab": "only 'mtad' maps between draft and target vocabularies",
}


def knob_owners(name: str) -> list[str]:
    """Which specx methods own a knob (for "belongs to another method" errors).

    vLLM fields that a specx method also takes are vLLM's, not owned by specx: with a
    vLLM method (or none) they must reach vLLM untouched.
    """
    return [
        m.name for m in METHODS.values()
        if (knob := m.knob(name)) is not None and not knob.vllm_field
    ]


def defaults_table_markdown() -> str:
    """The docs' defaults table (docs/methods/knobs.md), generated so it can never drift from
    the code (scripts/update_docs_tables.py writes it there)."""
    rows = [
        "| method | knob | default | allowed | meaning |",
        "|---|---|---|---|---|",
    ]
    for spec in METHODS.values():
        k_default = spec.default_num_speculative_tokens
        rows.append(
            f"| `{spec.name}` | `num_speculative_tokens` | "
            f"{k_default if k_default is not None else 'from the MTP config'} | "
            "an integer >= 1 | draft length K (the maximum, for adaptive stops) |"
        )
        if spec.needs_draft_model:
            rows.append(
                f"| `{spec.name}` | `model` | required | a local directory or hub id | "
                "the draft model |"
            )
        for knob in spec.knobs:
            default = "none" if knob.default is None else str(knob.default).lower()
            rows.append(
                f"| `{spec.name}` | `{knob.name}` | {default} | {knob.allowed} | {knob.help} |"
            )
    return "\n".join(rows)
