"""Steps where nobody drafts, forced in a running specx engine (issue 32): cost control
with a fixed cost model and scripted acceptance rates, so some steps plan zero drafts for
every request (runs of several such steps) and others draft, whatever the clock. Used by
the engine tests of `adaptive`'s draft model, the EAGLE-3 head and MTP (V1, and Model
Runner V2 in tests/v2) to show that a skipped first pass, caught up later, leaves every
draft, and every first pass's output, what it would have been with the pass run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from engine_requests import counter, generate, output_ids

COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


class ScriptedIdleRates:
    """Stands in for the control's acceptance history (``history.rates``): every request
    looks hopeless on each fourth step and on steps 8-11 of every 16 (all-zero steps, one
    or four in a row), and otherwise request ``i`` looks good on steps where
    ``(step + i) % 2 == 0`` (some steps draft for only some requests)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.step = 0
        self.first: int | None = None  # the run's first request id (ids count on)

    def __call__(self, req_ids: list[str]) -> Any:
        self.step += 1
        out = np.full((len(req_ids), self.k), 0.02)
        idle = self.step % 4 == 3 or 8 <= self.step % 16 <= 11
        ids = [int(str(rid).rsplit("-", 1)[0]) for rid in req_ids]
        if self.first is None:
            self.first = min(ids)
        for row, n in enumerate(ids):
            i = (n - self.first) % 4
            if not idle and (self.step + i) % 2 == 0:
                out[row] = 0.95
        return out


class ScriptedMostlyIdleRates:
    """Every request looks hopeless except on each eighth step, when all look good: runs
    of seven all-zero steps, so nearly every request has a hole open at any step (a
    preemption lands in one, and the resumed request's first step is usually skipped)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.step = 0

    def __call__(self, req_ids: list[str]) -> Any:
        self.step += 1
        return np.full((len(req_ids), self.k), 0.95 if self.step % 8 == 0 else 0.02)


# A memory-bound target: a good request's drafts pay, a hopeless one's never.
MEMORY_BOUND = dict(target_base=1.0, target_per_request=0.02, target_per_token=0.02,
                    draft_pass=0.02, draft_row=0.01)
# A compute-bound target: not even a certainly accepted draft token pays for its row.
COMPUTE_BOUND = {**MEMORY_BOUND, "target_per_token": 2.0}


def scripted_control(drafter: Any, k: int, rates: Any) -> Any:
    """A new cost control on ``drafter`` (what one run learns, acceptance or calibration,
    must not change another's plans) with a fixed :data:`MEMORY_BOUND` cost model, no
    probes (zero means zero) and ``rates`` standing in for its acceptance history's."""
    from vllm_specx.algorithms.draft_length import StepCosts

    drafter._cost_control = None
    control = drafter.cost_control(k)
    control.fixed_costs = StepCosts(**MEMORY_BOUND)
    control.history.probe_interval = 10**9
    control.history.rates = rates
    return control


class ScriptedTreeDepths:
    """Stands in for the tree cost control's depth choice (``choose_depth``): depth 0 on
    :class:`ScriptedIdleRates`'s all-zero steps (each fourth step, steps 8-11 of every
    16), the full depth on the others."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self, num_reqs: int, max_depth: int, skips_first_pass: bool = False,
                 whole: bool = False) -> int:
        self.step += 1
        idle = self.step % 4 == 3 or 8 <= self.step % 16 <= 11
        return 0 if idle or num_reqs == 0 else max_depth


class ScriptedShortTreeDepths(ScriptedTreeDepths):
    """Depth 0 on steps 2-3 of every 4, the full depth on the others: runs of two
    depth-0 rounds in requests of only a few rounds (a draft the target accepts)."""

    def __call__(self, num_reqs: int, max_depth: int, skips_first_pass: bool = False,
                 whole: bool = False) -> int:
        self.step += 1
        return 0 if self.step % 4 in (2, 3) or num_reqs == 0 else max_depth


def scripted_tree_control(drafter: Any, depths: Callable[[], Any] = ScriptedTreeDepths
                          ) -> Any:
    """A new tree cost control on a tree ``drafter`` with a fixed cost model under
    which nearly every drafted node pays (a verified node costs 1e-4 of a step: the
    trees stay trees) and :class:`ScriptedTreeDepths` choosing its depths: the tree
    analogue of :func:`scripted_control`."""
    from vllm_specx.algorithms.draft_length import StepCosts
    from vllm_specx.glue.tree_cost import tree_cost_control_for

    drafter._tree_cost = None
    control = tree_cost_control_for(drafter)
    control.fixed_costs = StepCosts(**{**MEMORY_BOUND, "target_per_token": 1e-4})
    control.choose_depth = depths()
    return control


def _drafted(drafter: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             drafts: Any) -> tuple[list[str], list[list[int]]]:
    """One ``propose`` call's request ids and drafts, on either runner: V1's proposers
    return one list (or row) per request of the runner's batch; a Model Runner V2
    speculator is handed the batch (``input_batch``) and returns its ``[R, K]`` draft
    buffer, the length of each request's draft kept for the scheduler
    (``_draft_lengths``; None: K for every request)."""
    batch = kwargs.get("input_batch", args[0] if args else None)
    if hasattr(batch, "req_ids"):
        ids = list(batch.req_ids[: drafts.shape[0]])
        lengths = getattr(drafter, "_draft_lengths", None)
        return ids, [row[: lengths[r]] if lengths is not None else row
                     for r, row in zip(ids, drafts.tolist())]
    ids = list(drafter.runner.input_batch.req_ids[: len(drafts)])
    return ids, [[int(t) for t in d] for d in drafts]


def run_idle_steps(llm: Any, drafter: Any, k: int, prompts: list[list[int]],
                   params: Any, max_hole: int | None = None,
                   fresh_prefix_cache: bool = False, tree: bool = False,
                   rates: Callable[[int], Any] = ScriptedIdleRates,
                   tree_depths: Callable[[], Any] = ScriptedTreeDepths) -> dict[str, Any]:
    """Generate ``prompts`` twice under the same scripted plans: once skipping the
    head's first pass on all-zero steps (its KV caught up later, in passes of at most 3
    tokens or, a draft model on V1, inside the next first pass, with the hole
    bookkeeping in 4-position blocks so skipped steps also catch up
    block ends), once with every first pass run. Returns both outputs, each run's drafts
    per round (request ids relative to the run's first) and acceptance counts, and the
    hole record's stats. ``max_hole``: a head's bound on a request's hole (steps that
    would pass it run their first pass). ``fresh_prefix_cache``: reset vLLM's prefix cache
    before each run (and after the last), so both runs compute the prompts in the same
    steps. The drafter's settings are restored afterwards. Runs where the engine is: a
    V1 engine in the test process, or a Model Runner V2 one in the V2 host (its
    speculator as ``drafter``). ``tree``: ``drafter`` drafts trees (a head's, or
    ``adaptive``'s draft-model tree); the tree cost control's depths are scripted instead
    (:func:`scripted_tree_control`). ``rates``: the
    scripted acceptance's class (:class:`ScriptedIdleRates` unless given); ``tree_depths``
    the scripted tree depths' (:class:`ScriptedTreeDepths` unless given)."""

    saved = dict(drafter.settings)
    saved_tree_control = getattr(drafter, "_tree_cost", None)
    original = drafter.propose
    rounds: list[tuple[list[str], list[list[int]]]] = []

    def propose(*args: Any, **kwargs: Any) -> Any:
        drafts = original(*args, **kwargs)
        if not kwargs.get("dummy_run"):  # V2 warms its speculator up through propose
            rounds.append(_drafted(drafter, args, kwargs, drafts))
        return drafts

    original_round = drafter.draft_round
    first_passes: list[list[list[float]]] = []

    def draft_round(start: Any, sampling: Any) -> Any:
        # The first pass's output rows of every round that drafts: what the head read
        # from its KV cache (a catch-up that wrote nothing, or the wrong slots, changes
        # them even where this small head's argmax drafts stay the same).
        drafts = original_round(start, sampling)
        if any(len(d) for d in drafts):
            first_passes.append(start.out.float().cpu().tolist())
        return drafts

    drafter.settings = {**saved, "cost_control": True}
    saved_control = drafter._cost_control

    def fresh_control() -> Any:
        if tree:
            return scripted_tree_control(drafter, tree_depths)
        return scripted_control(drafter, k, rates(k))

    drafter._kv_holes = None  # a fresh hole record: its stats are this call's
    holes = drafter.kv_holes()
    holes.pass_tokens, holes.block_size = 3, 4
    if max_hole is not None:
        holes.max_hole = max_hole
    out: dict[str, Any] = {}
    drafter.propose = propose
    drafter.draft_round = draft_round
    try:
        for name, skip in (("skip", True), ("no_skip", False)):
            fresh_control()
            if not skip:
                drafter.skips_idle_first_pass = False
            rounds.clear()
            first_passes.clear()
            if fresh_prefix_cache:
                llm.reset_prefix_cache()
            before = [counter(llm, c) for c in COUNTERS]
            out[name] = output_ids(generate(llm, prompts, params))
            out[name + "_counts"] = [counter(llm, c) - b for c, b in zip(COUNTERS, before)]
            first = min(int(str(i).rsplit("-", 1)[0]) for ids, _ in rounds for i in ids)
            out[name + "_rounds"] = [([int(str(i).rsplit("-", 1)[0]) - first for i in ids], d)
                                     for ids, d in rounds]
            out[name + "_first_passes"] = list(first_passes)
            if skip:
                out["holes"] = dict(holes.as_dict())
    finally:
        drafter.propose = original
        drafter.__dict__.pop("draft_round", None)
        drafter.__dict__.pop("skips_idle_first_pass", None)
        drafter.settings = saved
        drafter._cost_control = saved_control
        drafter._tree_cost = saved_tree_control
        if fresh_prefix_cache:
            llm.reset_prefix_cache()
    return out


def first_pass_gap(idle: dict[str, Any]) -> float:
    """The largest difference between the two runs' first-pass outputs over the rounds
    that drafted, relative to their largest magnitude (0.0: bit for bit the same)."""
    skip, no_skip = idle["skip_first_passes"], idle["no_skip_first_passes"]
    assert len(skip) == len(no_skip) > 0
    gap = scale = 0.0
    for a, b in zip(skip, no_skip):
        x, y = np.asarray(a), np.asarray(b)
        assert x.shape == y.shape
        gap = max(gap, float(np.abs(x - y).max()))
        scale = max(scale, float(np.abs(y).max()))
    return gap / max(scale, 1e-12)


def check_idle_steps(idle: dict[str, Any], plain: list[list[int]]) -> None:
    """What the tests assert on :func:`run_idle_steps`'s result (``plain``: the outputs
    without speculation)."""
    holes = idle["holes"]
    assert holes["skipped_first_passes"] > 0, holes
    # Holes of several positions caught up in passes of at most 3 tokens, or (a draft
    # model on V1) in front of the next first pass's queries, whole.
    merged = holes.get("merged_catch_ups", 0)
    assert holes["catch_up_tokens"] > holes["catch_up_passes"] + merged, holes
    assert holes["catch_up_passes"] + merged > 0, holes
    assert holes["catch_up_steps"] > 0, holes
    assert idle["skip"] == idle["no_skip"] == plain
    skip, no_skip = idle["skip_rounds"], idle["no_skip_rounds"]
    assert sum(not any(d) for _, d in skip) > 1  # all-zero steps happened
    assert any(any(d) for _, d in skip)  # and drafting ones
    # Token for token the drafts of a drafter that never skipped (a catch-up that wrote
    # nothing leaves stale head KV, and the drafts after a skip differ)...
    assert skip == no_skip
    # ... and what its first passes computed: a fixture head's argmax can stay the same
    # over stale KV (on V2's held-out requests it did: the first passes then differed by
    # 0.4-0.5% with no catch-up or with zeroed hidden states fed to it; 0.0 caught up).
    assert first_pass_gap(idle) <= 1e-5
    drafted, accepted = idle["skip_counts"]
    assert drafted > 0 and accepted > 0
    assert idle["skip_counts"] == idle["no_skip_counts"]


class ScriptedRetirement:
    """Acceptance rates for :func:`run_retirement`: every request looks good on steps
    1-2, hopeless on the next ``hopeless`` steps (all-zero steps: the first pass is
    skipped), and good again from then on."""

    def __init__(self, k: int, hopeless: int) -> None:
        self.k, self.hopeless = k, hopeless
        self.step = 0

    def __call__(self, req_ids: list[str]) -> Any:
        self.step += 1
        good = not 3 <= self.step < 3 + self.hopeless
        return np.full((len(req_ids), self.k), 0.95 if good else 0.02)


def run_retirement(llm: Any, drafter: Any, k: int, prompts: list[list[int]],
                   params: Any, retire_after: int = 3) -> dict[str, Any]:
    """Generate ``prompts`` under :class:`ScriptedRetirement` plans with the hole record's
    ``retire_after`` at ``retire_after`` skipped steps: every request retires during the
    hopeless stretch; then the same prompts again as new requests, on a fresh script.
    Then, on that control (past ``retire_after`` idle plans in a row, acceptance good), the
    same prompts twice more as new requests: under :data:`COMPUTE_BOUND` costs, where
    they retire on arrival (``arrival``), and back under the memory-bound costs, where
    they are admitted and draft (``admitted``).
    Returns the outputs, each round's request ids, drafts and the requests retired
    before and after it (``rounds``, ``rounds_again``, ``rounds_arrival``,
    ``rounds_admitted``), and the hole record's stats after the second and the last run.
    The drafter's settings are restored afterwards; V1 engine or Model Runner V2 host, as
    :func:`run_idle_steps`."""
    from vllm_specx.algorithms.draft_length import StepCosts

    saved = dict(drafter.settings)
    saved_control = drafter._cost_control
    original = drafter.propose
    rounds: list[tuple[list[str], list[list[int]], list[str]]] = []
    saved_holes = getattr(drafter, "_kv_holes", None)
    drafter._kv_holes = None
    holes = drafter.kv_holes()
    holes.retire_after = retire_after

    def propose(*args: Any, **kwargs: Any) -> Any:
        retired = sorted(holes.retired)
        drafts = original(*args, **kwargs)
        if not kwargs.get("dummy_run"):
            ids, d = _drafted(drafter, args, kwargs, drafts)
            rounds.append((ids, d, retired, sorted(holes.retired)))
        return drafts

    def fresh_control() -> Any:
        return scripted_control(drafter, k, ScriptedRetirement(k, hopeless=retire_after + 3))

    out: dict[str, Any] = {}
    drafter.settings = {**saved, "cost_control": True}
    drafter.propose = propose
    try:
        for name in ("rounds", "rounds_again", "rounds_arrival", "rounds_admitted"):
            if name in ("rounds", "rounds_again"):
                control = fresh_control()
            else:
                control.fixed_costs = StepCosts(
                    **(COMPUTE_BOUND if name == "rounds_arrival" else MEMORY_BOUND))
                # Acceptance good from here on: the script reads step by step, and a
                # batch whose requests are all retired reads no rates (nothing to weigh),
                # so its stretch is not counted off by the steps after the retirements.
                control.history.rates = ScriptedRetirement(k, hopeless=0)
            rounds.clear()
            out[name.replace("rounds", "out")] = output_ids(generate(llm, prompts, params))
            out[name] = list(rounds)
            if name == "rounds_again":
                out["holes"] = dict(holes.as_dict())
            if name == "rounds_arrival":
                out["holes_arrival"] = dict(holes.as_dict())
        out["holes_last"] = dict(holes.as_dict())
    finally:
        drafter.propose = original
        drafter.settings = saved
        drafter._cost_control = saved_control
        drafter._kv_holes = saved_holes
    return out


def check_retirement(res: dict[str, Any], plain: list[list[int]]) -> None:
    """What the tests assert on :func:`run_retirement`'s result."""
    assert res["out"] == res["out_again"] == plain
    n = len(plain)
    # Every request of each run retired (the second run's too: its script goes hopeless).
    assert res["holes"]["retired_requests"] == 2 * n, res["holes"]
    for name in ("rounds", "rounds_again"):
        rounds = res[name]
        before = [r for r in rounds if not set(r[0]) & set(r[2])]
        after = [r for r in rounds if set(r[0]) <= set(r[2])]
        # Drafting before the hopeless stretch; once retired, nothing is drafted on the
        # steps after (and there were such steps), where the script says good again had
        # the plan read it (a batch of retired requests reads no rates).
        assert any(any(d) for _, d, _, _ in before)
        assert len(after) > 2
        assert all(not any(d) for _, d, _, _ in after)
    # The second run's requests are new: they drafted, whatever the first run's retired.
    first_ids = {i for ids, _, _, _ in res["rounds"] for i in ids}
    assert not first_ids & {i for ids, _, _, _ in res["rounds_again"] for i in ids}
    # Arrival: with not even a sure token paying, every new request retired in its first
    # round (before any first pass or catch-up), and nothing was drafted.
    assert res["out_arrival"] == res["out_admitted"] == plain
    arrival, admitted = res["rounds_arrival"], res["rounds_admitted"]
    arrival_ids = {i for ids, _, _, _ in arrival for i in ids}
    assert res["holes_last"]["retired_on_arrival"] == len(arrival_ids) == n
    assert res["holes"]["retired_on_arrival"] == 0
    for ids, d, _, after in arrival:
        assert set(ids) <= set(after) and not any(d)
    # Every round of that run skipped its first pass, and nothing was caught up.
    was, now = res["holes"], res["holes_arrival"]
    assert now["skipped_first_passes"] - was["skipped_first_passes"] == len(arrival)
    assert now["catch_up_passes"] == was["catch_up_passes"]
    # Where drafting pays again, the next new requests are admitted and draft.
    assert not {i for _, _, _, after in admitted for i in after} & {
        i for ids, _, _, _ in admitted for i in ids}
    assert any(any(d) for _, d, _, _ in admitted)
