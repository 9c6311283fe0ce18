"""The target's forward cost by number of query tokens, in vLLM's real CPU engine.

One in-process engine (``vllm_specx.engine.make_llm``, prefix caching on) per run:

1. caches ``--batch`` prompts of ``--context`` random tokens (whole 32-token blocks);
2. for q = 1..``--max-query``: submits each cached prompt plus q new tokens with
   ``max_tokens=1``, so the engine computes exactly q query tokens per request on
   ``--context`` tokens of cached context -- the shape of a verification forward of
   q - 1 drafts -- and a hook on the target times that forward plus ``compute_logits``
   on all its rows (what verification needs; the engine itself asks logits for the last
   row only, so the hook times the all-row call itself); CPU time of the process (what a
   forward costs without waiting for a core on a shared machine) and wall clock;
3. decodes ``--decode-tokens`` tokens per request without speculation and reports the
   engine step (wall clock per generated token per request) against the model's share,
   so the time outside the model per step is visible.

Each q is repeated ``--repeats`` times; medians. One configuration per process (vLLM
fixes torch's thread count for the process at the first engine)::

    OMP_NUM_THREADS=1 python benchmarks/cpu_step_costs.py --dtype bfloat16 --threads 1
    python benchmarks/cpu_step_costs.py --target fixtures/models/target --context 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

# (tokens, wall s, CPU s of this process) of each forward + logits: in "query" mode
# the forward plus an all-row compute_logits of the hook's own; in "decode" mode the
# forward plus the engine's own compute_logits call that follows it.
_RECORDS: list[tuple[int, float, float]] = []
_MODE = {"all_row_logits": True}


def _install_hook(worker: Any) -> str:
    """Runs in the (in-process) worker: time each target forward and its logits."""
    inner = getattr(worker, "worker", worker)
    model = inner.model_runner.get_model()
    state: dict[str, Any] = {}
    engine_logits = model.compute_logits

    def timed_logits(*args: Any, **kwargs: Any) -> Any:
        if _MODE["all_row_logits"] or not _RECORDS:
            return engine_logits(*args, **kwargs)
        c0, w0 = time.process_time(), time.perf_counter()
        out = engine_logits(*args, **kwargs)
        n, w, c = _RECORDS[-1]
        _RECORDS[-1] = (n, w + time.perf_counter() - w0, c + time.process_time() - c0)
        return out

    model.compute_logits = timed_logits

    def pre(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        state["tokens"] = int(ids.shape[0]) if ids is not None else -1
        state["t0"] = time.perf_counter()
        state["c0"] = time.process_time()

    def post(module: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if _MODE["all_row_logits"]:
            hidden = out[0] if isinstance(out, tuple) else out
            engine_logits(hidden)
        _RECORDS.append((state["tokens"], time.perf_counter() - state["t0"],
                         time.process_time() - state["c0"]))

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)
    return type(model).__name__


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="default: the real pair's target")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--max-query", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--engine-args", default="{}", help="extra vllm.LLM keyword arguments")
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
    llm = make_llm(target, dtype=args.dtype, torch_threads=args.threads,
                   enable_prefix_caching=True, max_num_seqs=max(batches),
                   kv_cache_memory_bytes=256 << 20, **json.loads(args.engine_args))
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm.collective_rpc(_install_hook)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        gen = torch.Generator().manual_seed(0)
        nmax = max(batches)
        contexts = [torch.randint(100, vocab - 100, (args.context,), generator=gen).tolist()
                    for _ in range(nmax)]
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=c) for c in contexts], one, use_tqdm=False)
        result: dict[str, Any] = {
            "target": target, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "context": args.context, "load_before": os.getloadavg(), "query": {},
            "query_wall": {}, "decode": {},
        }
        for b in batches:
            per_q, per_q_wall = {}, {}
            for q in range(1, args.max_query + 1):
                times, walls = [], []
                for _rep in range(args.repeats):
                    extra = torch.randint(100, vocab - 100, (q,), generator=gen).tolist()
                    prompts = [TokensPrompt(prompt_token_ids=c + extra) for c in contexts[:b]]
                    _RECORDS.clear()
                    llm.generate(prompts, one, use_tqdm=False)
                    times += [c for n, _, c in _RECORDS if n == b * q]
                    walls += [w for n, w, _ in _RECORDS if n == b * q]
                per_q[q] = statistics.median(times) * 1e3 if times else None
                per_q_wall[q] = statistics.median(walls) * 1e3 if walls else None
            result["query"][b] = per_q
            result["query_wall"][b] = per_q_wall
            # Plain decoding: the engine step against the model's share of it.
            decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0,
                                    ignore_eos=True)
            prompts = [TokensPrompt(prompt_token_ids=c[: args.context // 2]) for c in contexts[:b]]
            _RECORDS.clear()
            _MODE["all_row_logits"] = False
            cpu0, t0 = time.process_time(), time.perf_counter()
            llm.generate(prompts, decode, use_tqdm=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            _MODE["all_row_logits"] = True
            model_s = [c for n, _, c in _RECORDS if n == b]
            model_wall = [w for n, w, _ in _RECORDS if n == b]
            step_ms = wall / args.decode_tokens * 1e3
            result["decode"][b] = {
                "step_ms": step_ms, "cpu_step_ms": cpu / args.decode_tokens * 1e3,
                "model_cpu_ms": statistics.median(model_s) * 1e3 if model_s else None,
                "model_ms": statistics.median(model_wall) * 1e3 if model_wall else None,
                # every forward of the run, the prompts' prefill included
                "model_cpu_total_ms": sum(c for _, _, c in _RECORDS) * 1e3 / args.decode_tokens,
            }
        result["load_after"] = os.getloadavg()
    finally:
        shutdown_llm(llm)
    print(f"# {args.dtype}, {result['threads']} thread(s), context {args.context}, "
          f"load {result['load_before'][0]:.2f} -> {result['load_after'][0]:.2f}")
    for b, per_q in result["query"].items():
        base = per_q[1]
        print(f"batch {b}: CPU ms " + " ".join(f"{q}:{v:.1f}" for q, v in per_q.items())
              + " | x one token " + " ".join(f"{v / base:.2f}" for v in per_q.values()))
        wall = result["query_wall"][b]
        print(f"batch {b}: wall ms " + " ".join(f"{q}:{v:.1f}" for q, v in wall.items()))
        d = result["decode"][b]
        print(f"batch {b}: decode step {d['step_ms']:.1f} ms wall, {d['cpu_step_ms']:.1f} ms CPU;"
              f" model (median) {d['model_ms']:.1f} ms wall, {d['model_cpu_ms']:.1f} ms CPU; "
              f"outside the model {d['cpu_step_ms'] - d['model_cpu_total_ms']:.1f} ms CPU "
              f"per step")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
