"""Measure MTAD's draft-model cost in the real engine (a script, not a test).

For K in {2, 4, 8} (one engine each) and B in {1, 2, 4, 8} (changed on the live drafter),
it runs the same requests and reports, per request and drafting round:

* first-pass tokens: the draft pass over the verified tokens (what vanilla draft-model
  drafting also spends);
* tail tokens: the beam-tail passes at depths 1..K-1 with KV-prefix reuse (measured);
* full recompute: the same without reuse, B*K*(K-1)/2 (exact, counted by the proposer);
* vanilla: K-1, what chain drafting spends after its first pass;
* draft forward passes per round: K with all beams of a depth in one pass (the default,
  per-beam KV slots), 1 + B*(K-1) with one pass per beam (``batched_beams = False``, the
  drafter before issue 15); vanilla: K;
* accepted tokens per target pass (block efficiency) for the configuration;
* draft wall time per drafting round (the whole ``propose`` call, all requests of the
  batch; this machine, so only the ratios between rows carry over).

Usage (from the repository root)::

    VLLM_TARGET_DEVICE=cpu .venv/bin/python tests/mtad/measure_draft_cost.py [--json out.json]

Uses the trained fixture pair (fixtures/models) when it exists, else the tiny random pair
of the engine tests (acceptance is then meaningless, costs are not).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def workload(use_fixture: bool, n: int):
    import torch

    if use_fixture:
        from transformers import AutoTokenizer

        from vllm_specx.fixtures import fixture_model_dirs, heldout_prompts

        target, draft = fixture_model_dirs()
        tok = AutoTokenizer.from_pretrained(target)
        prompts = [tok(p)["input_ids"][-64:] for p in heldout_prompts(n)]
        return str(target), str(draft), prompts
    from engine_support import make_tiny_pair

    root = Path(tempfile.mkdtemp(prefix="mtad_cost_"))
    target, draft = make_tiny_pair(root)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 96, (int(m),), generator=g).tolist() for m in (7, 19, 33, 12)]
    return target, draft, prompts[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tiny", action="store_true", help="use the tiny random pair")
    args = ap.parse_args()

    from vllm_specx.fixtures import fixtures_root

    use_fixture = not args.tiny
    if use_fixture:
        try:
            fixtures_root()
        except FileNotFoundError:
            use_fixture = False
    target, draft, prompts = workload(use_fixture, args.requests)

    from engine_support import start_engine
    from vllm import SamplingParams

    rows = []
    for k in (2, 4, 8):
        eng = start_engine(
            target,
            draft,
            k,
            num_beams=8,  # the scratch KV region is reserved for the widest B measured
            skip_tokenizer_init=not use_fixture,
            max_model_len=256,
            max_num_batched_tokens=256,
            max_num_seqs=args.requests,
        )
        propose_seconds = [0.0]
        timed = eng.drafter.propose

        def propose(*a, _timed=timed, _acc=propose_seconds, **kw):
            start = time.perf_counter()
            try:
                return _timed(*a, **kw)
            finally:
                _acc[0] += time.perf_counter() - start

        eng.drafter.propose = propose
        try:
            for b, batched in [(b, m) for b in (1, 2, 4, 8) for m in (True, False)]:
                if b == 1 and not batched:
                    continue  # B = 1 is chain drafting either way
                seconds_before = propose_seconds[0]
                eng.drafter.num_beams = b
                eng.drafter.batched_beams = batched
                before = eng.drafter.stats.as_dict()
                params = [
                    SamplingParams(
                        temperature=args.temperature,
                        top_k=20,
                        top_p=0.9,
                        max_tokens=args.max_tokens,
                        seed=i,
                    )
                    for i in range(len(prompts))
                ]
                seqs = eng.generate(prompts, params)
                after = eng.drafter.stats.as_dict()
                d = {key: after[key] - before[key] for key in after}
                req_rounds = d["requests"]
                generated = sum(len(s) for s in seqs.values()) - sum(len(p) for p in prompts)
                row = {
                    "K": k,
                    "B": b,
                    "batched": batched,
                    "request_rounds": req_rounds,
                    "first_pass_tokens_per_req_round": d["first_pass_tokens"] / req_rounds,
                    "tail_tokens_per_req_round": d["tail_tokens"] / req_rounds,
                    "full_recompute_tail_per_req_round": d["full_recompute_tail_tokens"]
                    / req_rounds,
                    "vanilla_tail_per_req_round": k - 1,
                    "draft_passes_per_round": 1 + d["tail_forward_passes"] / d["rounds"],
                    "tokens_per_target_pass": generated / max(1, req_rounds),
                    "draft_ms_per_round": 1000 * (propose_seconds[0] - seconds_before)
                    / max(1, d["rounds"]),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            eng.close()
    print()
    print(
        "| K | B | batched | first pass | tail (reuse) | tail (full recompute) | vanilla tail |"
        " draft passes/round | draft ms/round | tokens/target pass |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['K']} | {r['B']} | {'yes' if r['batched'] else 'no'} | "
            f"{r['first_pass_tokens_per_req_round']:.2f} | "
            f"{r['tail_tokens_per_req_round']:.2f} | "
            f"{r['full_recompute_tail_per_req_round']:.0f} | "
            f"{r['vanilla_tail_per_req_round']} | {r['draft_passes_per_round']:.1f} | "
            f"{r['draft_ms_per_round']:.1f} | "
            f"{r['tokens_per_target_pass']:.2f} |"
        )
    print()
    print("| K | B = 1 | B = 2 | B = 4 | B = 8 | B = 8, one pass per beam |")
    print("|---|---|---|---|---|---|")
    for k in sorted({r["K"] for r in rows}):
        cells = []
        for b, batched in ((1, True), (2, True), (4, True), (8, True), (8, False)):
            r = next(x for x in rows if x["K"] == k and x["B"] == b and x["batched"] == batched)
            cells.append(
                f"{r['tail_tokens_per_req_round']:.1f} tok, "
                f"{r['draft_passes_per_round']:.0f} passes, {r['draft_ms_per_round']:.1f} ms"
            )
        print(f"| {k} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"fixture": use_fixture, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
