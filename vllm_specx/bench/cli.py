"""``vllm-specx bench``: the command line of the benchmark.

    vllm-specx bench                                   # real pair (SmolLM2-135M), default configs
    vllm-specx bench --pair fixture                    # the tests' tiny fixture pair
    vllm-specx bench --config '{"method": "mtad", "num_beams": 8, "name": "mtad B=8"}'
    vllm-specx bench --target T --draft D --prompts p.jsonl --max-tokens 128 -o out/r.json
    vllm-specx bench --batch-sizes 1,8,32              # speed-up against batch size, cost
                                                       # control on and off (bench/sweep.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUTPUT = Path("bench-out") / "report.json"
DEFAULT_NUM_PROMPTS = 8
DEFAULT_MAX_TOKENS = 64
DEFAULT_K = 4
# K of the real pair's default configurations, every method: the shipped SmolLM2 drafter
# accepts ~18% of first drafts and few after (greedy block efficiency 1.16 / 1.18 at K = 1
# / 2), and draft_model K=1 matched or beat K=2 in CPU-time speed-up in every cell of the
# "Real pair" table (docs/benchmarks/real-pair.md; bfloat16, batch 1, T=0: 0.93-1.01 vs
# 0.86-0.95); a longer K only adds rejected drafts.
REAL_PAIR_K = 1
# K of vLLM's eagle3 over the shipped EAGLE-3 head (vllm_specx/models/smollm2_eagle3/).
REAL_PAIR_EAGLE3_K = 3
PAIRS = ("real", "fixture")
# The pair used without --target; scripts that reproduce the fixture tables export "fixture".
PAIR_ENV = "VLLM_SPECX_BENCH_PAIR"
# The real target's KV cache per token is ~45 KiB (30 layers): 64 MiB would not hold 8
# chat prompts with their continuations, so the real pair's engines get more by default.
REAL_PAIR_ENGINE_DEFAULTS = {"kv_cache_memory_bytes": 256 << 20}


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to the ``vllm-specx`` sub-commands (called by ``vllm_specx.cli``)."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark speculative configurations on the real vLLM engine",
        description=(
            "Run the vLLM engine offline on the platform present, once without speculation "
            "and once per speculative configuration, over a prompt set; report verification "
            "and discard rates, block efficiency, acceptance, padding, perplexity, wall clock "
            "and the projected speed-up from measured per-forward costs (SpecDec++ eq. 2.3). "
            "Writes a JSON report, a markdown table and PNG plots. The defaults (the real "
            "pair: SmolLM2-135M-Instruct, fetched and converted once by `vllm-specx "
            "fetch-target`, with the drafter shipped in the package; "
            f"{DEFAULT_NUM_PROMPTS} held-out prompts x {DEFAULT_MAX_TOKENS} tokens, "
            "ngram and draft_model with K=4 plus the available specx methods, and on the "
            "real pair vLLM's eagle3 and specx_eagle3 over the shipped EAGLE-3 head) take several "
            "minutes on a laptop CPU; --pair fixture runs the tests' tiny pair in a few."
        ),
    )
    p.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT,
                   help="JSON report path; the markdown table and the PNG plots are written "
                   "next to it (same stem); default: %(default)s")
    p.add_argument("--config", action="append", default=None, metavar="JSON",
                   help="a speculative configuration to run, the dict you would pass to vLLM's "
                   "speculative_config (repeatable); an optional \"name\" key labels it; "
                   "without \"model\" it gets --draft (except model-free methods such as "
                   "ngram). Replaces the default configurations; the baseline always runs")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                   help="prompt file: one JSON string or {\"prompt\": ...} object per line "
                   "(default: the pair's held-out prompts)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"use the first N prompts (default: {DEFAULT_NUM_PROMPTS} held-out "
                   "prompts, or every prompt of --prompts)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature, 0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="top-k sampling, 0 = off (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="top-p sampling, 1 = off (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="request i is sampled with seed + i; also the engine seed unless "
                   "--engine-args sets one (default: %(default)s)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-tokens tokens (equal lengths across configs)")
    p.add_argument("--pair", choices=PAIRS, default=None,
                   help="the target/draft pair and held-out prompts used where --target, "
                   "--draft, --prompts are not given: real = SmolLM2-135M-Instruct (converted "
                   "once into the user's cache) and its shipped drafter, fixture = the tiny "
                   f"pair of the tests (default: ${PAIR_ENV}, else real)")
    p.add_argument("--target", type=Path, default=None,
                   help="target model directory (default: the --pair target)")
    p.add_argument("--draft", type=Path, default=None,
                   help="default draft model directory (default: the --pair draft)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help="K of the default configurations, ignored with --config "
                   f"(default: {REAL_PAIR_K} for every method of the real pair; "
                   f"{DEFAULT_K} for ngram and draft_model of the fixture pair, the "
                   "specx methods' own defaults)")
    p.add_argument("--engine-args", type=str, default=None, metavar="JSON",
                   help="extra vllm.LLM keyword arguments for every engine, e.g. "
                   "'{\"enforce_eager\": false, \"max_model_len\": 2048}' (defaults: "
                   "vllm_specx.engine.CPU_ENGINE_DEFAULTS, among them max_num_seqs 8: "
                   "the batch, so '{\"max_num_seqs\": 1}' for batch 1; dtype bfloat16 on "
                   "a CPU with native bfloat16, else float32, or $VLLM_SPECX_CPU_DTYPE)")
    p.add_argument("--batch-sizes", type=str, default=None, metavar="B1,B2,...",
                   help="sweep: the benchmark once per batch size (max_num_seqs = B, at "
                   "least B prompts: the prompt set repeated), every configuration under "
                   "cost control (the default of adaptive, mtad and the adaptive specx_* "
                   "heads) also with \"cost_control\": false; writes each batch "
                   "size's report as STEM_bB.json and the speed-up against batch size as "
                   "STEM_batch_sweep.csv / .png / .md (docs/cost-control.md)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--verbose", action="store_true", help="show vLLM's own log lines")
    p.set_defaults(func=cmd_bench)
    return p


def _fail(message: str) -> int:
    print(f"vllm-specx bench: error: {message}", file=sys.stderr)
    return 2


def _has_nvidia_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no bindings, no driver: no GPU
        return False


def prepare_environment(verbose: bool) -> None:
    """Environment vLLM reads at import: quiet logs, and its CPU platform when no GPU."""
    if not verbose:
        # vLLM's start-up warnings (missing tcmalloc, Triton, ...) would bury the results.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if "VLLM_TARGET_DEVICE" not in os.environ and not _has_nvidia_gpu():
        from vllm_specx.engine import ensure_cpu_env

        ensure_cpu_env()


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _BadArguments(Exception):
    """A command-line error: reported as one line, exit status 2, before any engine."""


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; 0 on success, 1 if a configuration
    failed (the others are still reported), 2 on bad arguments."""
    try:
        engine_overrides = _engine_overrides(args)
        batch_sizes = _batch_sizes(args, engine_overrides)
        pair = _pair(args)
        parsed = _parsed_configs(args, pair)
        target, draft = _models(args, pair, parsed, engine_overrides)
        prompt_set, names, configs = _prompts_and_configs(args, pair, parsed, draft)
    except _BadArguments as exc:
        return _fail(str(exc))

    prepare_environment(args.verbose)
    from vllm_specx.bench.core import BenchOptions, run_benchmark
    from vllm_specx.bench.engine_run import Sampling

    opts = BenchOptions(
        target=str(target),
        draft=str(draft) if draft else None,
        configs=list(zip(names, configs)),
        prompts=prompt_set,
        sampling=Sampling(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        ),
        engine_overrides=engine_overrides,
    )
    if batch_sizes:
        return _run_sweep(opts, batch_sizes, args.output, plots=not args.no_plots)
    report = run_benchmark(opts, log=_log)
    _write_outputs(report, args.output, plots=not args.no_plots)
    failed = [c["name"] for c in report["configs"] if "error" in c]
    if failed:
        _log(f"[bench] configurations that failed: {failed}")
        return 1
    return 0


def _engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Check the numeric arguments; ``--engine-args`` as a dict (with the seed)."""
    if args.max_tokens < 1:
        raise _BadArguments("--max-tokens must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise _BadArguments("--num-prompts must be >= 1")
    if args.temperature < 0:
        raise _BadArguments("--temperature must be >= 0")
    try:
        engine_overrides = json.loads(args.engine_args) if args.engine_args else {}
    except json.JSONDecodeError as exc:
        raise _BadArguments(f"--engine-args is not JSON: {exc.msg}") from None
    if not isinstance(engine_overrides, dict):
        raise _BadArguments("--engine-args must be a JSON object")
    engine_overrides.setdefault("seed", args.seed)
    return engine_overrides


def _batch_sizes(args: argparse.Namespace, engine_overrides: dict[str, Any]) -> list[int]:
    """``--batch-sizes`` as a list (empty without it); it sets max_num_seqs itself."""
    if not args.batch_sizes:
        return []
    from vllm_specx.bench.sweep import parse_batch_sizes

    try:
        sizes = parse_batch_sizes(args.batch_sizes)
    except ValueError as exc:
        raise _BadArguments(str(exc)) from None
    if "max_num_seqs" in engine_overrides:
        raise _BadArguments("--batch-sizes sets max_num_seqs for each run: leave it out of "
                            "--engine-args")
    return sizes


def _run_sweep(opts: Any, batch_sizes: list[int], out: Path, *, plots: bool) -> int:
    """The benchmark at each batch size (cost-controlled configurations twice: on and
    off), each batch size's outputs as ``STEM_bB.*``, then the sweep's table, CSV and
    plot (``bench/sweep.py``)."""
    from dataclasses import replace

    from vllm_specx.bench.core import run_benchmark
    from vllm_specx.bench.report import _subtitle
    from vllm_specx.bench.sweep import (
        prompts_for_batch,
        sweep_rows,
        sweep_table,
        with_control_twins,
        write_sweep_csv,
        write_sweep_plot,
    )

    configs = with_control_twins(opts.configs)
    stem = out.with_suffix("")
    reports: dict[int, dict[str, Any]] = {}
    for b in batch_sizes:
        _log(f"[bench] batch size {b}: {len(configs)} configurations")
        run_opts = replace(opts, configs=configs, prompts=prompts_for_batch(opts.prompts, b),
                           engine_overrides={**opts.engine_overrides, "max_num_seqs": b})
        reports[b] = run_benchmark(run_opts, log=_log)
        _write_outputs(reports[b], stem.with_name(f"{stem.name}_b{b}.json"), plots=plots)
    rows = sweep_rows(reports)
    table = sweep_table(rows)
    md_path = stem.with_name(stem.name + "_batch_sweep.md")
    md_path.write_text(table, encoding="utf-8")
    written = [md_path, write_sweep_csv(rows, stem)]
    if plots:
        written.append(write_sweep_plot(rows, stem, _subtitle(reports[batch_sizes[-1]])))
    print(table)
    _log("[bench] wrote " + ", ".join(str(p) for p in written))
    failed = sorted({r["name"] for r in rows if r.get("error")})
    if failed:
        _log(f"[bench] configurations that failed: {failed}")
        return 1
    return 0


def _pair(args: argparse.Namespace) -> str:
    pair = args.pair or os.environ.get(PAIR_ENV) or "real"
    if pair not in PAIRS:
        raise _BadArguments(f"{PAIR_ENV}={pair!r} is not a pair; allowed: {', '.join(PAIRS)}")
    return pair


def _parsed_configs(args: argparse.Namespace, pair: str) -> list[tuple[str | None, dict]]:
    """(name or None, config) per ``--config``, else the pair's default configurations."""
    from vllm_specx.bench.configs import default_configs, parse_config_arg

    try:
        parsed = [parse_config_arg(text) for text in (args.config or [])]
    except ValueError as exc:
        raise _BadArguments(str(exc)) from None
    if args.config:
        return parsed
    if pair == "real":
        from vllm_specx.bench.configs import (
            REAL_PAIR_EAGLE3_TREE,
            REAL_PAIR_TREE,
            needs_eagle_head,
        )
        from vllm_specx.real_pair import eagle3_dir

        k = args.num_speculative_tokens or REAL_PAIR_K
        head = eagle3_dir()
        configs = default_configs(k, eagle3_head=str(head) if head else None,
                                  eagle3_k=args.num_speculative_tokens or REAL_PAIR_EAGLE3_K,
                                  draft_tree=REAL_PAIR_TREE, eagle3_tree=REAL_PAIR_EAGLE3_TREE)
        # The EAGLE-3 configurations keep their own K (the head's drafts are accepted far
        # more often than the drafter's; specx_eagle3's adaptive stop picks each length
        # up to its default 8) unless -k names one for all; a head's tree keeps its own
        # node budget always.
        return [(None, cfg if needs_eagle_head(cfg["method"]) and (
                    not args.num_speculative_tokens or "draft_tree" in cfg)
                 else {**cfg, "num_speculative_tokens": k}) for cfg in configs]
    return [(None, cfg) for cfg in default_configs(args.num_speculative_tokens or DEFAULT_K)]


def _models(
    args: argparse.Namespace, pair: str, parsed: list[tuple[str | None, dict]],
    engine_overrides: dict[str, Any],
) -> tuple[Any, Any]:
    """The target and default draft directories: the arguments, else the pair's (the real
    pair's target is fetched on first use and its engines get a larger KV cache)."""
    target, draft = args.target, args.draft
    needs_draft = draft is None and _any_needs_draft(parsed)
    if pair == "real" and (target is None or needs_draft):
        from vllm_specx import real_pair

        try:
            # The drafter first: it is a quick check, the target may mean a download.
            draft = draft or (real_pair.draft_dir() if needs_draft else None)
            target = target or real_pair.ensure_target(log=_log)
        except real_pair.RealPairError as exc:
            raise _BadArguments(f"{exc} (or pass --pair fixture)") from None
        for key, value in REAL_PAIR_ENGINE_DEFAULTS.items():
            engine_overrides.setdefault(key, value)
    elif target is None or needs_draft:
        from vllm_specx.fixtures import fixture_model_dirs

        try:
            fx_target, fx_draft = fixture_model_dirs()
        except FileNotFoundError as exc:
            raise _BadArguments(f"{exc} (or pass --target and --draft)") from None
        target = target or fx_target
        draft = draft or fx_draft
    return target, draft


def _prompts_and_configs(
    args: argparse.Namespace, pair: str, parsed: list[tuple[str | None, dict]], draft: Any,
) -> tuple[Any, list[str], list[dict[str, Any]]]:
    """The prompt set, and each configuration's unique name and final dict (with the
    default draft filled in where it needs one)."""
    from vllm_specx.bench.configs import default_name, unique_names, with_default_draft
    from vllm_specx.bench.prompts import default_prompts, read_jsonl

    draft_path = str(draft) if draft else None
    try:
        if args.prompts is not None:
            prompt_set = read_jsonl(args.prompts, args.num_prompts)
        elif pair == "real":
            from vllm_specx.real_pair import HELDOUT_PROMPTS

            prompt_set = read_jsonl(HELDOUT_PROMPTS, args.num_prompts or DEFAULT_NUM_PROMPTS)
        else:
            prompt_set = default_prompts(args.num_prompts or DEFAULT_NUM_PROMPTS)
        configs = [with_default_draft(cfg, draft_path) for _, cfg in parsed]
    except (OSError, ValueError) as exc:
        raise _BadArguments(str(exc)) from None
    names = unique_names(
        name or default_name(cfg, draft_path) for (name, _), cfg in zip(parsed, configs)
    )
    return prompt_set, names, configs


def _write_outputs(report: dict[str, Any], out: Path, *, plots: bool) -> None:
    """The JSON report, the markdown table (printed too, verdict first) and the plots."""
    from vllm_specx.bench.report import markdown_table, write_plots

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    table = markdown_table(report)
    stem = out.with_suffix("")
    md_path = stem.with_name(stem.name + ".md")
    md_path.write_text(table, encoding="utf-8")
    written = [out, md_path]
    if plots:
        written += write_plots(report, stem)
    print(table)
    _log("[bench] wrote " + ", ".join(str(p) for p in written))


def _any_needs_draft(parsed: list[tuple[str | None, dict[str, Any]]]) -> bool:
    from vllm_specx.bench.configs import needs_default_draft

    return any(needs_default_draft(cfg) for _, cfg in parsed)
