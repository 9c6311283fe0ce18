"""What a step costs when cost control drafts nothing for anyone, against a plain decode step.

Three in-process engines, all alive at once, warmed up, timed passes interleaved
(``A B C A B C ...``; round_parity.py's method):

* ``no speculation``: vLLM without a speculative config;
* ``adaptive, plans 0, pass skipped``: ``adaptive`` whose cost control is forced to plan
  zero drafts every step (acceptance 0, no probes): the drafter skips its first pass
  (``DraftKVHoles`` in glue/draft_passes.py; with prefix caching it still runs one first
  pass, with the catch-up, where a request's hole would reach its KV block's end);
* ``adaptive, plans 0, pass run``: the same, with every first pass run (the behaviour
  before the skip);
* ``adaptive, plans 0, verify path`` (``--compare-sampler``): pass skipped, but the step
  without drafts sampled through the rejection sampler's verification path with zero
  drafts per row and vLLM's input preparation kernel run after it (the behaviour before
  the shortcuts: ``SpecxRejectionSampler.plain_sampling_without_drafts``,
  ``SpecxPasses.prepare_inputs_padded`` and ``prepare_next_token_ids_padded``).

``--method specx_eagle3`` runs the same rows for ``specx_eagle3`` with ``"adaptive": true``
over the pair's EAGLE-3 head (real pair: the shipped head; fixture: the tests' head, built
into a temporary directory): the skipped row skips the head's first pass (``HeadKVHoles``
in glue/head_kv_holes.py keeps its inputs for the catch-up), the run row is what the head
did before (its first pass over the batch every step, no logits).

Greedy, ``ignore_eos``; decode steps only (steps with prefill tokens are not counted)::

    python benchmarks/zero_draft_step.py --pair fixture --batch 1
    python benchmarks/zero_draft_step.py --pair real --batch 8 --max-tokens 32
    python benchmarks/zero_draft_step.py --pair real --batch 8 --method specx_eagle3

Reported per row: CPU ms and wall ms per decode step (median over the repeats, with the
spread), the CPU ms inside the drafter's ``propose`` per step, and whether the outputs
equal no speculation's. Wall clock on a shared machine moves with its load (printed).

``--split`` also times the step's parts on the process CPU clock (``_SplitClock``: the
scheduler's ``schedule`` / ``update_from_output``, the runner's state update, input
preparation (spec-decode metadata inside it), attention metadata, the target's forward
(EAGLE-3's auxiliary hidden-state capture inside it), the sampler, the bookkeeping, the
drafter's ``propose`` and vLLM's ``prepare_next_token_ids_padded``), per decode step and,
for the steps with prompt tokens, per prefill token. The parts nest as listed in
``_SPLIT``'s comments, so they do not add up to the step. Prefill steps are those with
prompt tokens (the prompts of a run are prefix-cached from the warm-up unless
``--reset-prefix-cache``); their parts are per token the step scheduled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from vllm_specx.bench.clocks import CpuClock

K = 4


def _force_zero(llm: Any, skip: bool) -> Any:
    """Cost control planning zero drafts every step, whatever it measures."""
    import numpy as np

    from vllm_specx.algorithms.draft_length import StepCosts

    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    drafter.settings["cost_control"] = True
    control = drafter.cost_control(K)
    control.fixed_costs = StepCosts(target_base=1.0, target_per_request=0.02,
                                    target_per_token=0.05, draft_pass=0.08, draft_row=0.01,
                                    draft_round=0.05)
    control.history.rates = lambda ids: np.zeros((len(ids), K))
    control.history.probe_interval = 10**9
    drafter.skips_idle_first_pass = skip
    return drafter


def _propose_clock(drafter: Any) -> CpuClock:
    """A clock on the drafter's ``propose``."""
    clock = CpuClock()
    drafter.propose = clock.wrap(drafter.propose)
    return clock


# (owner, attribute): owner "runner", "scheduler", "drafter" (absent without speculation),
# "holes" (a skipping drafter's hole record), "head" (the drafter's model).
# Nesting: the engine step holds schedule, execute_model, sample_tokens and
# update_from_output; execute_model holds
# _update_states, _prepare_inputs (which holds _calc_spec_decode_metadata),
# _build_attention_metadata and _model_forward; sample_tokens holds _sample,
# _bookkeeping_sync and propose_draft_token_ids (which holds the drafter's
# prepare_next_token_ids_padded and propose).
_SPLIT = (
    ("scheduler", "schedule"),
    ("scheduler", "update_from_output"),
    ("runner", "execute_model"),
    ("runner", "_update_states"),
    ("runner", "_prepare_inputs"),
    ("runner", "_calc_spec_decode_metadata"),
    ("runner", "_build_attention_metadata"),
    ("runner", "_model_forward"),
    ("runner", "sample_tokens"),
    ("runner", "_sample"),
    ("runner", "_bookkeeping_sync"),
    ("runner", "propose_draft_token_ids"),
    ("drafter", "prepare_next_token_ids_padded"),
    ("drafter", "propose"),
    # inside propose: the plan (cost control), and the skip's hole bookkeeping
    # (``holes``: the drafter's DraftKVHoles / HeadKVHoles) with its catch-up passes
    ("drafter", "plan_before_first_pass"),
    ("holes", "keep_first_pass_inputs"),
    ("holes", "skip"),
    ("holes", "catch_up"),
    ("holes", "_catch_up_spans"),
    # EAGLE-3: the head's fc over the target's auxiliary hidden states (every step)
    ("head", "combine_hidden_states"),
)


class _SplitClock:
    """Process CPU seconds inside each of ``_SPLIT``'s calls (instance attributes wrap
    the bound methods, so vLLM's own calls ``self.x(...)`` go through them)."""

    def __init__(self, llm: Any, drafter: Any) -> None:
        core = llm.llm_engine.engine_core.engine_core
        skipping = drafter is not None and drafter.skips_idle_first_pass
        owners = {"scheduler": core.scheduler,
                  "runner": llm.llm_engine.model_executor.driver_worker.worker.model_runner,
                  "drafter": drafter,
                  "holes": drafter.kv_holes() if skipping else None,
                  "head": getattr(drafter, "model", None)}
        self.clocks: dict[str, CpuClock] = {}
        self.scheduled_tokens = 0  # the tokens the last step's schedule() scheduled
        for owner, name in _SPLIT:
            obj = owners[owner]
            if obj is None or not hasattr(obj, name):
                continue
            key = f"{owner}.{name}"
            self.clocks[key] = CpuClock()
            fn = self.clocks[key].wrap(getattr(obj, name))
            setattr(obj, name, self._counting(fn) if key == "scheduler.schedule" else fn)

    def _counting(self, schedule: Any) -> Any:
        """The scheduler's ``schedule``, counting the tokens it scheduled."""
        def counted(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            self.scheduled_tokens += out.total_num_scheduled_tokens
            return out
        return counted

    def snapshot(self) -> dict[str, float]:
        return {key: clock.seconds for key, clock in self.clocks.items()}


def _run(llm: Any, prompts: list[str], max_tokens: int, split: _SplitClock | None = None,
         ) -> tuple[float, float, int, list, dict[str, float], dict[str, float], int]:
    """All prompts at once (the batch is max_num_seqs); CPU s, wall s and count of the
    decode-only steps, the outputs in prompt order, and (with ``split``) the CPU s in each
    timed part over the decode steps and over the steps with prompt tokens, and the prompt
    tokens those steps computed."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    tag = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{tag}-{i}", prompt, params)
    cpu = wall = 0.0
    steps = 0
    outs: dict[int, list[int]] = {}
    sched = engine.engine_core.engine_core.scheduler if hasattr(
        engine.engine_core, "engine_core") else None
    dec: dict[str, float] = {}
    pre: dict[str, float] = {}
    prefill_tokens = 0
    while engine.has_unfinished_requests():
        prefill = sched is not None and (
            bool(sched.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens
                                       for r in sched.running))
        s0 = split.snapshot() if split else {}
        if split:
            split.scheduled_tokens = 0
        c0, w0 = time.process_time(), time.perf_counter()
        out = engine.step()
        c1, w1 = time.process_time(), time.perf_counter()
        s1 = split.snapshot() if split else {}
        into = pre if prefill else dec
        for key in s1:
            into[key] = into.get(key, 0.0) + s1[key] - s0[key]
        if prefill:
            into["step"] = into.get("step", 0.0) + c1 - c0
            prefill_tokens += split.scheduled_tokens if split else 0
        else:
            cpu += c1 - c0
            wall += w1 - w0
            steps += 1
        for o in out:
            if o.finished:
                outs[int(o.request_id.rsplit("-", 1)[1])] = list(o.outputs[0].token_ids)
    return cpu, wall, steps, [outs[i] for i in sorted(outs)], dec, pre, prefill_tokens


def _eagle3_head(pair: str) -> str:
    """The pair's EAGLE-3 head: the shipped one for the real pair, the tests' fixture
    head (scripts/build_eagle3_fixture.py, seeded, built into a temporary directory)."""
    if pair == "real":
        from vllm_specx.real_pair import eagle3_dir

        head = eagle3_dir()
        if head is None:
            raise SystemExit("--method specx_eagle3: the real pair's EAGLE-3 head is missing")
        return str(head)
    import importlib.util
    import tempfile
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "build_eagle3_fixture.py"
    spec = importlib.util.spec_from_file_location("build_eagle3_fixture", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.build(Path(tempfile.mkdtemp(prefix="eagle3_head_"))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("fixture", "real"), default="fixture")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compare-sampler", action="store_true",
                    help="add the row whose steps without drafts take the verification path")
    ap.add_argument("--method", choices=("adaptive", "specx_eagle3"), default="adaptive",
                    help="the drafter forced to plan zero (specx_eagle3: adaptive, over the "
                         "pair's EAGLE-3 head)")
    ap.add_argument("--split", action="store_true",
                    help="time the step's parts (scheduler, input preparation, forward, "
                         "sampler, propose, ...) per decode step and per prefill token")
    ap.add_argument("--reset-prefix-cache", action="store_true",
                    help="empty vLLM's prefix cache before every run, so each run's "
                         "prefill computes its prompts (the per-prefill-token split)")
    ap.add_argument("--without-run-row", action="store_true",
                    help="leave out the row with every first pass run")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_specx.bench.pairs import pair_inputs
    from vllm_specx.engine import default_dtype, ensure_cpu_env, make_llm, shutdown_llm

    ensure_cpu_env()
    target, draft, prompts, overrides = pair_inputs(args.pair, args.batch)
    overrides["max_num_seqs"] = args.batch
    spec = {"method": "adaptive", "model": draft, "num_speculative_tokens": K}
    if args.method == "specx_eagle3":
        spec = {"method": "specx_eagle3", "model": _eagle3_head(args.pair),
                "num_speculative_tokens": K, "adaptive": True}
    m = args.method
    rows_cfg = [("no speculation", None, None),
                (f"{m}, plans 0, pass skipped", spec, True)]
    if not args.without_run_row:
        rows_cfg.append((f"{m}, plans 0, pass run", spec, False))
    if args.compare_sampler:
        rows_cfg.append((f"{m}, plans 0, verify path", spec, True))
    engines = []
    for name, cfg, skip in rows_cfg:
        llm = make_llm(target, speculative_config=cfg, **overrides)
        drafter = _force_zero(llm, skip) if cfg is not None else None
        if name.endswith("verify path"):
            from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

            runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
            runner.rejection_sampler.plain_sampling_without_drafts = False
            # and vLLM's input preparation with its kernel, as before the shortcut
            drafter.prepare_inputs_padded = (  # type: ignore[method-assign]
                SpecDecodeBaseProposer.prepare_inputs_padded.__get__(drafter))
            drafter.prepare_next_token_ids_padded = (  # type: ignore[method-assign]
                SpecDecodeBaseProposer.prepare_next_token_ids_padded.__get__(drafter))
        clock = _propose_clock(drafter) if drafter is not None else None
        split = _SplitClock(llm, drafter) if args.split else None
        _run(llm, prompts, args.max_tokens, split)  # warm-up, not counted
        engines.append((name, llm, clock, drafter, split))

    rows = {n: {"cpu": [], "wall": [], "prop": []} for n, _, _ in rows_cfg}
    parts: dict[str, dict[str, list[float]]] = {n: {} for n, _, _ in rows_cfg}
    outputs: dict[str, list] = {}
    steps: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, llm, clock, _, split in engines:
            before = clock.seconds if clock else 0.0
            if args.reset_prefix_cache:
                llm.reset_prefix_cache()
            cpu, wall, n, outs, dec, pre, ptok = _run(llm, prompts, args.max_tokens, split)
            rows[name]["cpu"].append(1000 * cpu / n)
            rows[name]["wall"].append(1000 * wall / n)
            rows[name]["prop"].append(1000 * ((clock.seconds if clock else 0.0) - before) / n)
            outputs[name], steps[name] = outs, n
            for key, sec in dec.items():
                parts[name].setdefault(f"decode ms/step {key}", []).append(1000 * sec / n)
            for key, sec in pre.items():
                parts[name].setdefault(f"prefill us/token {key}", []).append(
                    1e6 * sec / max(ptok, 1))
    ref = outputs[rows_cfg[0][0]]
    result = []
    for name, llm, _, drafter, _ in engines:
        r = rows[name]
        stats = drafter.specx_stats().get("cost_control", {}) if drafter else {}
        result.append({
            "config": name,
            "cpu_ms_per_step": round(statistics.median(r["cpu"]), 3),
            "cpu_ms_spread": [round(min(r["cpu"]), 3), round(max(r["cpu"]), 3)],
            "wall_ms_per_step": round(statistics.median(r["wall"]), 3),
            "wall_ms_spread": [round(min(r["wall"]), 3), round(max(r["wall"]), 3)],
            "propose_cpu_ms_per_step": round(statistics.median(r["prop"]), 3),
            "decode_steps": steps[name],
            "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config
                                     .async_scheduling),
            "idle_first_pass": stats.get("idle_first_pass"),
            "same_output_as_no_speculation": outputs[name] == ref,
        })
        if parts[name]:
            result[-1]["split_cpu"] = {k: round(statistics.median(v), 3)
                                       for k, v in parts[name].items()}
    for _, llm, _, _, _ in engines:
        shutdown_llm(llm)
    print(json.dumps({"pair": args.pair, "dtype": default_dtype(), "batch": args.batch,
                      "max_tokens": args.max_tokens, "repeats": args.repeats,
                      "load": os.getloadavg(), "rows": result}, indent=1))
    base = result[0]
    for r in result:
        cpu_x = r["cpu_ms_per_step"] / base["cpu_ms_per_step"]
        wall_x = r["wall_ms_per_step"] / base["wall_ms_per_step"]
        print(f"{r['config']:34s} cpu {r['cpu_ms_per_step']:8.3f} ms/step "
              f"({cpu_x:.3f}x) {r['cpu_ms_spread']} "
              f"wall {r['wall_ms_per_step']:8.3f} ({wall_x:.3f}x) "
              f"propose-cpu {r['propose_cpu_ms_per_step']:7.3f} steps {r['decode_steps']} "
              f"async {r['async_scheduling']} same {r['same_output_as_no_speculation']}",
              file=sys.stderr)
    if args.split:
        keys = list(result[0].get("split_cpu", {}))
        for r in result[1:]:
            keys += [k for k in r.get("split_cpu", {}) if k not in keys]
        print(f"{'CPU, median over repeats':48s}" + "".join(
            f"{r['config'][-14:]:>16s}" for r in result), file=sys.stderr)
        for key in keys:
            print(f"{key:48s}" + "".join(
                f"{r.get('split_cpu', {}).get(key, float('nan')):16.3f}" for r in result),
                file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
