"""Ops, host reads and host time per decode step: vLLM's ``eagle3`` K against
``specx_eagle3`` K (no ``adaptive``: both draft exactly K every step), batch 1, greedy.

On a GPU an eager 135M model is launch-bound: what a step costs there is its host work
(Python, one kernel launch per aten op, host syncs). This CPU script counts that work
per decode step, split by where it runs, so the two rounds can be compared without a
GPU::

    python benchmarks/round_ops.py --pair fixture -k 3     # the tests' pair + fixture head
    python benchmarks/round_ops.py --pair real -k 3        # SmolLM2-135M + shipped head

Per row and scope (``propose``: the drafter's; ``sampler``: the rejection sampler's
forward; ``step``: the runner's ``execute_model`` + ``sample_tokens``, the target's
forward included):

* ``aten_ops``: aten ops that reach a kernel (a ``TorchDispatchMode`` counts each op
  after decomposition: about one kernel launch each on a GPU);
* ``launches``: those of them that would launch a kernel (not views, metadata-only
  ops, allocations or ``to`` calls that copy nothing). Ops on host tensors (the
  metadata vLLM and specx build on the host) are counted too: they cost host time but
  no launch on a GPU, so both counts over-state a GPU's launches alike;
* ``host_reads``: calls that bring tensor values to the host (``item``, ``tolist``,
  ``cpu``/``to("cpu")``, ``bool``/``int``/``float``, ``nonzero``, ``torch.equal``,
  ``numpy``) with their call sites. On this CPU run every tensor is a host tensor, so
  this over-counts: a read of a tensor vLLM keeps on the host (``*_cpu``) costs no sync
  on a GPU. The call sites (``--sites``) say which;
* ``host_ms``: wall ms inside the scope, measured in separate, interleaved runs without
  the counters (on the fixture pair the models are tiny, so this is mostly host work).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
          "nonzero", "equal"}


# Ops that launch no kernel on a GPU: views and metadata-only ops, allocations (``to`` /
# ``_to_copy`` count only when they copy; see ``_Ops``).
_NO_LAUNCH = {"view", "_unsafe_view", "reshape", "_reshape_alias", "slice", "select",
              "unsqueeze", "squeeze", "expand", "t", "transpose", "permute", "as_strided",
              "alias", "detach", "lift_fresh", "resolve_conj", "resolve_neg", "split",
              "split_with_sizes", "unbind", "empty", "empty_like", "new_empty",
              "empty_strided", "item", "_local_scalar_dense", "to", "_to_copy"}


class _Counter:
    def __init__(self) -> None:
        self.scopes: list[str] = []
        self.ops: collections.Counter[str] = collections.Counter()
        self.launches: collections.Counter[str] = collections.Counter()
        self.op_names: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.reads: collections.Counter[str] = collections.Counter()
        self.sites: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.on = False


COUNT = _Counter()


def _site() -> str:
    for frame in reversed(traceback.extract_stack(limit=12)[:-2]):
        if "/torch/" not in frame.filename and "round_ops.py" not in frame.filename:
            path = frame.filename
            for cut in ("site-packages/", "/work/main/"):
                if cut in path:
                    path = path.split(cut, 1)[1]
            return f"{path}:{frame.lineno}"
    return "?"


class _Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if COUNT.on and COUNT.scopes:
            name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") \
                else str(func)
            out = func(*args, **(kwargs or {}))
            copies = name in ("to", "_to_copy") and not (args and out is args[0])
            for s in COUNT.scopes:
                COUNT.ops[s] += 1
                COUNT.launches[s] += name not in _NO_LAUNCH or copies
            COUNT.op_names[COUNT.scopes[-1]][name] += 1
            return out
        return func(*args, **(kwargs or {}))


class _Reads(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if COUNT.on and COUNT.scopes:
            name = getattr(func, "__name__", "")
            is_read = name in _READS
            if name == "to":
                dev = kwargs.get("device", args[1] if len(args) > 1 else None)
                is_read = isinstance(dev, (str, torch.device)) and str(dev) == "cpu"
            if is_read:
                for s in COUNT.scopes:
                    COUNT.reads[s] += 1
                COUNT.sites[COUNT.scopes[-1]][f"{name} @ {_site()}"] += 1
        return func(*args, **kwargs)


def _wrap(obj: Any, attr: str, scope: str, clock: dict[str, float]) -> None:
    original = getattr(obj, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        COUNT.scopes.append(scope)
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            clock[scope] = clock.get(scope, 0.0) + time.perf_counter() - t0
            COUNT.scopes.pop()

    setattr(obj, attr, wrapped)


def _run(llm: Any, prompts: list[str], max_tokens: int) -> tuple[int, list]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    steps, outs = 0, []
    for i, prompt in enumerate(prompts):  # batch 1
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
        first = True
        while engine.has_unfinished_requests():
            COUNT.on = not first  # decode steps only
            out = engine.step()
            COUNT.on = False
            steps += not first
            first = False
            outs += [list(o.outputs[0].token_ids) for o in out if o.finished]
    return steps, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("fixture", "real"), default="fixture")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sites", action="store_true", help="print host-read call sites")
    ap.add_argument("--ops", action="store_true", help="print the propose ops by name")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from zero_draft_step import _eagle3_head

    from vllm_specx.bench.pairs import pair_inputs
    from vllm_specx.engine import ensure_cpu_env, make_llm, shutdown_llm

    ensure_cpu_env()
    target, _, prompts, overrides = pair_inputs(args.pair, args.prompts)
    overrides["max_num_seqs"] = 1
    head = _eagle3_head(args.pair)
    configs = [(f"eagle3 K={args.k}", "eagle3"), (f"specx_eagle3 K={args.k}", "specx_eagle3")]
    engines = []
    for name, method in configs:
        llm = make_llm(target, speculative_config={
            "method": method, "model": head, "num_speculative_tokens": args.k}, **overrides)
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        clock: dict[str, float] = {}
        _wrap(runner, "execute_model", "step", clock)
        _wrap(runner, "sample_tokens", "step", clock)
        _wrap(runner.drafter, "propose", "propose", clock)
        _wrap(runner.rejection_sampler, "forward", "sampler", clock)
        _run(llm, prompts[:1], args.max_tokens)  # warm-up
        engines.append((name, llm, clock))

    report: dict[str, Any] = {}
    outputs = {}
    for name, llm, _ in engines:  # counted run (slow: the modes sit on every op)
        COUNT.__init__()
        with _Reads(), _Ops():
            steps, outs = _run(llm, prompts, args.max_tokens)
        outputs[name] = outs
        report[name] = {"steps": steps, **{
            f"{s}_{k}": round(getattr(COUNT, a)[s] / steps, 2)
            for s in ("propose", "sampler", "step")
            for k, a in (("aten_ops", "ops"), ("launches", "launches"),
                         ("host_reads", "reads"))}}
        report[name]["read_sites_per_step"] = {
            s: {site: round(n / steps, 2) for site, n in COUNT.sites[s].most_common()}
            for s in ("propose", "sampler", "step")}
        report[name]["propose_ops_by_name"] = {
            k: round(v / steps, 2) for k, v in COUNT.op_names["propose"].most_common()}
    times: dict[str, dict[str, list[float]]] = {n: collections.defaultdict(list)
                                                for n, _, _ in engines}
    for _ in range(args.repeats):  # timed runs, interleaved, no counters
        for name, llm, clock in engines:
            clock.clear()
            steps, _ = _run(llm, prompts, args.max_tokens)
            for s, v in clock.items():
                times[name][s].append(1000 * v / steps)
    for name, _, _ in engines:
        for s, v in times[name].items():
            report[name][f"{s}_host_ms"] = round(statistics.median(v), 3)
        report[name]["same_output_as_eagle3"] = outputs[name] == outputs[configs[0][0]]
    for _, llm, _ in engines:
        shutdown_llm(llm)
    if not args.sites:
        for r in report.values():
            r.pop("read_sites_per_step")
    if not args.ops:
        for r in report.values():
            r.pop("propose_ops_by_name")
    print(json.dumps({"pair": args.pair, "k": args.k, "prompts": len(prompts),
                      "max_tokens": args.max_tokens, "load": os.getloadavg(),
                      "rows": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
