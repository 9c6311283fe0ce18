"""Structured output (JSON) with MTAD against no speculation, on the fixture pair.

Issue 17, item 6: an outside probe saw 6/12 valid JSON objects with MTAD against 8/12
without speculation, the invalid ones running to the token limit in whitespace. This
measures it on enough samples: every configuration generates the same ``--num-seeds``
seeded requests per constraint (``json_object`` and a small ``json_schema``) through
vLLM's structured outputs (xgrammar), at temperature 1, and reports per configuration:

* ``valid``: the text parses as JSON (and, for the schema, validates against it);
* ``grammar_ok``: every generated token is accepted, one by one, by an independent
  xgrammar matcher for the same constraint (did the grammar reach every emitted token,
  including tokens accepted from drafts?);
* ``mean_len`` (tokens), ``hit_limit`` (finish reason ``length``);
* ``ws_frac``: share of whitespace characters in the text; ``ws_runaway``: the request
  hit the limit and its last 32 characters are all whitespace;
* for speculative configurations, vLLM's spec-decode counters: mean accepted tokens per
  draft, and ``draft_kept``: drafted tokens the scheduler kept after checking them
  against the grammar, over K x drafts (vLLM truncates a draft at its first token the
  grammar forbids; the draft model itself never sees the grammar).

Usage (about 10 minutes on 2 busy CPU cores)::

    python benchmarks/structured_output.py --num-seeds 100 --json bench-out/structured.json

Configurations: ``none`` (no speculation), ``draft_model`` (vLLM's lossless draft-model
speculation with the same draft, a control: it must match ``none`` in distribution),
``mtad`` (defaults: K=4, B=2, tau=0.1) and ``mtad tau=0.5``. ``--configs`` picks a subset.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from vllm_specx.engine import ensure_cpu_env

# Python-flavoured prompts (the fixture models were trained on the standard library's
# source) that lead into a JSON-like literal.
PROMPTS = [
    "import json\n\nDEFAULTS = json.loads('",
    "CONFIG = ",
    "def load_settings():\n    return ",
    "    payload = ",
]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "version": {"type": "integer"},
        "enabled": {"type": "boolean"},
    },
    "required": ["name", "version", "enabled"],
    "additionalProperties": False,
}

CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
    "mtad": {"method": "mtad"},
    "mtad tau=0.5": {"method": "mtad", "acceptance_threshold": 0.5},
}
DEFAULT_K = 4  # the specx and vLLM default num_speculative_tokens used above
RUNAWAY_CHARS = 32


def _constraint(mode: str):
    from vllm.sampling_params import StructuredOutputsParams

    if mode == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=SCHEMA)


def _is_valid(text: str, mode: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if mode == "json_object":
        return isinstance(value, dict)
    import jsonschema

    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


class GrammarReplay:
    """Feeds generated tokens to a fresh xgrammar matcher: True when all are accepted
    (and, for a request that stopped on EOS, the matcher could terminate there)."""

    def __init__(self, target_dir: str, any_whitespace: bool = True) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        compiler = xgr.GrammarCompiler(info)
        # The same options vLLM's xgrammar backend passes.
        separators = None if any_whitespace else (",", ":")
        self._xgr = xgr
        self._grammars = {
            # vLLM's xgrammar backend compiles json_object as the schema {"type": "object"}.
            "json_object": compiler.compile_json_schema('{"type": "object"}',
                                                        any_whitespace=any_whitespace,
                                                        separators=separators),
            "json_schema": compiler.compile_json_schema(json.dumps(SCHEMA),
                                                        any_whitespace=any_whitespace,
                                                        separators=separators),
        }
        self.eos = tokenizer.eos_token_id

    def accepts(self, mode: str, token_ids: list[int], stopped_on_eos: bool) -> bool:
        matcher = self._xgr.GrammarMatcher(self._grammars[mode])
        for tok in token_ids:
            if tok == self.eos:
                break
            if not matcher.accept_token(tok):
                return False
        return matcher.is_terminated() or not stopped_on_eos or matcher.accept_token(self.eos)


def _spec_counters(llm: Any) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}


def run_config(name: str, spec: dict[str, Any] | None, args: argparse.Namespace,
               replay: GrammarReplay) -> dict[str, Any]:
    from vllm import SamplingParams

    from vllm_specx.engine import make_llm, shutdown_llm
    from vllm_specx.fixtures import fixture_model_dirs

    target, draft = fixture_model_dirs()
    kwargs: dict[str, Any] = dict(
        # Every prompt is prefilled in one step: vLLM 0.32's CPU runner crashes on a seeded
        # request prefilled in chunks (docs/upstream-vllm-cpu-adapter-defects.md, defect 4).
        max_num_seqs=args.num_seeds, max_num_batched_tokens=8192,
        max_model_len=256, disable_log_stats=False,
        # vLLM's xgrammar backend reads disable_any_whitespace from the engine's config
        # only (the per-request field of StructuredOutputsParams is ignored there).
        structured_outputs_config={"backend": args.backend,
                                   "disable_any_whitespace": args.disable_any_whitespace},
    )
    if spec is not None:
        kwargs["speculative_config"] = {"model": str(draft), **spec}
    started = time.monotonic()
    llm = make_llm(target, **kwargs)
    results: dict[str, Any] = {"config": name, "speculative_config": spec, "modes": {}}
    try:
        for mode in ("json_object", "json_schema"):
            before = _spec_counters(llm)
            params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                     seed=seed, structured_outputs=_constraint(mode))
                      for seed in range(args.num_seeds)]
            prompts = [PROMPTS[seed % len(PROMPTS)] for seed in range(args.num_seeds)]
            outs = llm.generate(prompts, params, use_tqdm=False)
            after = _spec_counters(llm)
            rows = []
            for out in outs:
                o = out.outputs[0]
                text, ids = o.text, list(o.token_ids)
                tail = text[-RUNAWAY_CHARS:]
                rows.append({
                    "valid": _is_valid(text, mode),
                    "grammar_ok": replay.accepts(mode, ids, o.finish_reason == "stop"),
                    "len": len(ids),
                    "hit_limit": o.finish_reason == "length",
                    "ws_frac": sum(c.isspace() for c in text) / max(1, len(text)),
                    "ws_runaway": o.finish_reason == "length" and len(tail) == RUNAWAY_CHARS
                    and tail.isspace(),
                })
            n = len(rows)
            summary = {key: sum(float(r[key]) for r in rows) / n
                       for key in ("valid", "grammar_ok", "len", "hit_limit", "ws_frac",
                                   "ws_runaway")}
            summary["n"] = n
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            drafts = delta.get("vllm:spec_decode_num_drafts", 0.0)
            if drafts:
                k = (spec or {}).get("num_speculative_tokens", DEFAULT_K)
                summary["accepted_per_draft"] = (
                    delta["vllm:spec_decode_num_accepted_tokens"] / drafts)
                summary["draft_kept"] = delta["vllm:spec_decode_num_draft_tokens"] / (k * drafts)
            summary["examples_invalid"] = [
                outs[i].outputs[0].text[:120] for i, r in enumerate(rows) if not r["valid"]][:3]
            results["modes"][mode] = summary
    finally:
        shutdown_llm(llm)
    results["seconds"] = time.monotonic() - started
    return results


def markdown(all_results: list[dict[str, Any]]) -> str:
    lines = ["| config | constraint | n | valid | grammar ok | mean len | hit limit | "
             "whitespace | ws runaway | accepted/draft | draft kept |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in all_results:
        for mode, s in res["modes"].items():
            acc = f"{s['accepted_per_draft']:.2f}" if "accepted_per_draft" in s else "-"
            kept = f"{s['draft_kept']:.2f}" if "draft_kept" in s else "-"
            lines.append(
                f"| {res['config']} | {mode} | {s['n']} | {s['valid']:.2f} | "
                f"{s['grammar_ok']:.2f} | {s['len']:.1f} | {s['hit_limit']:.2f} | "
                f"{s['ws_frac']:.2f} | {s['ws_runaway']:.2f} | {acc} | {kept} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seeds", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--backend", default="xgrammar")
    parser.add_argument("--disable-any-whitespace", action="store_true",
                        help="engine-wide structured-output option: no optional whitespace")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    ensure_cpu_env()
    from vllm_specx.fixtures import fixture_model_dirs

    replay = GrammarReplay(str(fixture_model_dirs()[0]),
                           any_whitespace=not args.disable_any_whitespace)
    all_results = []
    for name in args.configs:
        res = run_config(name, CONFIGS[name], args, replay)
        all_results.append(res)
        print(markdown([res]).splitlines()[-2:], f"({res['seconds']:.0f} s)", flush=True)
    print(markdown(all_results))
    if args.json:
        import os

        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": all_results}, f, indent=1)


if __name__ == "__main__":
    main()
