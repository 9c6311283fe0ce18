"""The target's forward cost over a draft tree's query tokens, in vLLM's real CPU engine.

What a tree step costs the target: one forward over ``1 + n`` query tokens per request
(the root and ``n`` tree nodes) on cached context, each node attending only to its
ancestors. This script times exactly that, as ``benchmarks/cpu_step_costs.py`` times a
chain's verification forward (the cached prompt plus q new tokens, ``max_tokens=1``, a
hook on the target timing the forward plus ``compute_logits`` over every row), with the
tree's ancestor-only mask set on vllm-specx's CPU attention for the forward
(``cpu_ops.attention.query_masks``, as ``glue/tree_step.py`` sets it). The tree for q
query tokens is the draft-model tree's shape (``algorithms/sampled_tree.depth_sizes``:
4 nodes per depth, one of them expanded); the causal forward over the same tokens is
timed too, so the mask's own cost shows.

Query sizes 1, 2, 4, 8, 16 and 32 per request, batch 1 and 8 (options), each measured
``--repeats`` times, interleaved (every repeat runs every size and mode once, so a
change of load hits all of them alike); reported as the median CPU ms of the process and
its ratio to the one-token forward of the same batch, with the spread (min-max of the
per-repeat ratios). One command (from the repository root; the real pair's target is
downloaded once)::

    OMP_NUM_THREADS=1 python benchmarks/tree_target_cost.py

``--target DIR`` for another model, ``--dtype float32`` on an AVX2-only host,
``--json FILE`` for the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

# (query tokens, CPU s) of each target forward + all-row logits, in order.
_RECORDS: list[tuple[int, float]] = []
# Forwards that ran with the tree masks set (a check that the mask was applied).
_MASKED: list[int] = []
# What the next forward is: (batch, q, masked) while a measurement is submitted.
_PLAN: dict[str, Any] = {"shape": None}


def tree_parents(num_nodes: int, branching: int = 4) -> list[int]:
    """BFS parents of the draft-model tree's shape with ``num_nodes`` nodes: ``branching``
    nodes per depth, the first node of each depth expanded (-1: a child of the root)."""
    from vllm_specx.algorithms.sampled_tree import depth_sizes

    if num_nodes == 0:
        return []
    parents: list[int] = []
    parent, start = -1, 0
    for n in depth_sizes(num_nodes, 64, branching):
        parents += [parent] * n
        parent, start = start, start + n
    return parents


def _install_hook(worker: Any) -> str:
    """Runs in the (in-process) worker: set the tree masks and time each target forward."""
    import torch

    from vllm_specx.cpu_ops.attention import QueryMasks, query_masks
    from vllm_specx.glue.tree_step import tree_query_mask

    inner = getattr(worker, "worker", worker)
    model = inner.model_runner.get_model()
    state: dict[str, Any] = {}

    def pre(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        tokens = int(ids.shape[0]) if ids is not None else -1
        state["tokens"] = tokens
        state["ctx"] = None
        shape = _PLAN["shape"]
        if shape is not None:
            b, q, masked = shape
            if masked and q > 1 and tokens == b * q:
                mask = tree_query_mask(torch.tensor(tree_parents(q - 1), dtype=torch.int64))
                ctx = query_masks(QueryMasks.causal_except([q] * b, dict.fromkeys(range(b),
                                                                                  mask)))
                ctx.__enter__()
                state["ctx"] = ctx
        state["c0"] = time.process_time()

    def post(module: Any, args: tuple, kwargs: dict, out: Any) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        model.compute_logits(hidden)  # verification reads every row's logits
        cpu = time.process_time() - state["c0"]
        if state["ctx"] is not None:
            state["ctx"].__exit__(None, None, None)
            _MASKED.append(state["tokens"])
        _RECORDS.append((state["tokens"], cpu))

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)
    return type(model).__name__


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="default: the real pair's target")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--query", default="1,2,4,8,16,32",
                    help="comma-separated query tokens per request (root + nodes)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm_specx.engine import make_llm, shutdown_llm

    target = args.target
    if target is None:
        from vllm_specx.real_pair import ensure_target

        target = str(ensure_target(log=lambda m: print(m, file=sys.stderr)))
    batches = [int(b) for b in args.batch.split(",")]
    queries = [int(q) for q in args.query.split(",")]
    if queries[0] != 1:
        queries = [1] + queries
    llm = make_llm(target, dtype=args.dtype, torch_threads=args.threads,
                   enable_prefix_caching=True, max_num_seqs=max(batches),
                   max_num_batched_tokens=max(2048, max(batches) * max(queries)),
                   kv_cache_memory_bytes=256 << 20)
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specx.cpu_ops import registered_release

    if registered_release() is None:
        raise SystemExit("tree masks need vllm-specx's CPU attention (vLLM's compiled CPU "
                         "build takes no mask)")
    # samples[(b, q, masked)] = [CPU s per repeat]
    samples: dict[tuple[int, int, bool], list[float]] = {}
    try:
        llm.collective_rpc(_install_hook)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        gen = torch.Generator().manual_seed(0)
        contexts = [torch.randint(100, vocab - 100, (args.context,), generator=gen).tolist()
                    for _ in range(max(batches))]
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=c) for c in contexts], one, use_tqdm=False)
        load_before = os.getloadavg()
        for _rep in range(args.repeats):
            for b in batches:
                for q in queries:
                    for masked in ((False, True) if q > 1 else (False,)):
                        extra = torch.randint(100, vocab - 100, (q,), generator=gen).tolist()
                        prompts = [TokensPrompt(prompt_token_ids=c + extra)
                                   for c in contexts[:b]]
                        _RECORDS.clear()
                        _PLAN["shape"] = (b, q, masked)
                        llm.generate(prompts, one, use_tqdm=False)
                        _PLAN["shape"] = None
                        times = [c for n, c in _RECORDS if n == b * q]
                        if times:
                            samples.setdefault((b, q, masked), []).append(times[0])
        load_after = os.getloadavg()
    finally:
        shutdown_llm(llm)

    expected = args.repeats * len(batches) * sum(q > 1 for q in queries)
    print(f"# {target}, {args.dtype}, {args.threads} torch thread(s), context "
          f"{args.context}, {args.repeats} interleaved repeats, load "
          f"{load_before[0]:.2f} -> {load_after[0]:.2f}; {len(_MASKED)} of {expected} "
          "tree-mask forwards ran with the mask set")
    print("| batch | query tokens | tree mask: CPU ms (median) | x one token (median, "
          "spread) | causal: x one token (median) |")
    print("|---:|---:|---:|---|---:|")
    result: dict[str, Any] = {"target": target, "dtype": args.dtype, "context": args.context,
                              "repeats": args.repeats, "load": [load_before, load_after],
                              "rows": []}
    for b in batches:
        base = samples.get((b, 1, False), [])
        for q in queries:
            mode = (b, q, q > 1)
            cur = samples.get(mode, [])
            causal = samples.get((b, q, False), [])
            if not cur or not base:
                print(f"| {b} | {q} | (no sample) | | |")
                continue
            k = min(len(cur), len(base))
            ratios = [cur[i] / base[i] for i in range(k)]
            causal_ratio = (statistics.median([causal[i] / base[i] for i in
                                               range(min(len(causal), len(base)))])
                            if causal else float("nan"))
            print(f"| {b} | {q} | {statistics.median(cur) * 1e3:.1f} | "
                  f"{statistics.median(ratios):.2f} ({_spread(ratios)}) | {causal_ratio:.2f} |")
            result["rows"].append({"batch": b, "query": q, "cpu_ms": statistics.median(cur) * 1e3,
                                   "ratio": statistics.median(ratios), "ratios": ratios,
                                   "causal_ratio": causal_ratio})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
