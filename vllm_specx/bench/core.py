"""The benchmark run: the baseline, every configuration, the report.

One engine per run, started and shut down in turn: first the target without speculation
(the baseline row, the reference outputs and t_target), then each speculative
configuration (its row and its own t_draft), then the target without speculation again
(the ``baseline (after)`` row). Every engine is warmed up before it is timed
(``engine_run.run_config``), and every speed-up is against the mean of the two baseline
runs, whose spread the report and the verdict give (:data:`BASELINE_METHOD`): a cold
first engine, or a machine that got busier during the run, then favours no row.

Per-forward costs are measured inside those runs: hooks time every ``forward`` and
``compute_logits`` call of the target and of the drafter's model (see
``runner._ForwardTimer``). t_target is the baseline's decoding forward (one token per
running request); t_draft is the configuration's own drafting forward, in place, with the
batch and lengths it really had. Engine overhead (scheduling, sampling, detokenising,
CPU-side proposing) is deliberately not part of a forward: the projection is about model
work, and the wall clock reports the rest.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform as _platform
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_specx.bench.configs import is_model_free
from vllm_specx.bench.energy import EnergyMeter
from vllm_specx.bench.engine_run import RunResult, Sampling, run_config
from vllm_specx.bench.metrics import (
    SPEEDUP_FORMULA,
    DrafterStats,
    config_metrics,
    forward_cost,
    forward_time_stats,
    model_time_speedup,
)
from vllm_specx.bench.prompts import PromptSet

SCHEMA = "vllm-specx-bench/1"

COST_METHOD = (
    "hooks on each model's forward and compute_logits inside the benchmark runs (wall clock "
    "on CPU, CUDA events on GPU): cost of a forward = median duration of the calls with the "
    "most common token count + median compute_logits duration. t_target from the baseline's "
    "decoding forwards (one token per running request); t_draft from each configuration's "
    "own draft-model forwards; model-free drafters (ngram, suffix) cost 0. Engine overhead "
    "(scheduling, sampling, CPU-side proposing) is not part of a forward"
)
FALLBACK_COST_METHOD = (
    "no forward was observed (e.g. CUDA-graph replay): t_target = median wall time of the "
    "baseline's full-batch decode engine steps, engine overhead included"
)

BASELINE_METHOD = (
    "every engine is warmed up first (every prompt, up to 16 tokens each, the run's own "
    "sampling; not counted; the prefix cache is emptied after it, so the timed prompts are "
    "new to every engine); no speculation runs twice, first and last, and each "
    "configuration's wall-clock and CPU-time speed-ups are against the mean of those two "
    "runs; spread = (max - min) / mean of their tokens/s"
)

FORMULAS = {
    "verification_rate": "target_forward_passes / generated_tokens",
    "discard_rate": "(drafted_tokens - emitted_draft_tokens) / generated_tokens, "
    "emitted_draft_tokens = generated_tokens - target_forward_passes",
    "block_efficiency": "generated_tokens / target_forward_passes",
    "mean_acceptance_length": "1 + accepted_tokens / verification_steps (vLLM's definition)",
    "acceptance_per_position": "steps accepting draft position i / steps drafting position i",
    "padding_ratio": "(scheduled - needed) / needed verification positions; a step with k "
    "drafts needs k + 1",
    "perplexity": "exp(-sum(target logprob of each generated token) / generated_tokens)",
    "projected_speedup": SPEEDUP_FORMULA,
    "draft_forward_passes": "N_draft: the drafter's own count if it reports one; else "
    "verification_steps x (draft-model forwards / drafting rounds, both counted by hooks); "
    "else drafted_tokens",
    "projected_tokens_per_s": "baseline tokens_per_s * projected_speedup",
    "measured_speedup": "tokens_per_s / baseline tokens_per_s (the mean of the baseline's "
    "runs before and after the configurations)",
    "cpu_speedup": "tokens_per_cpu_s / baseline tokens_per_cpu_s (mean of its two runs); "
    "tokens_per_cpu_s = generated "
    "tokens / CPU seconds of this process during generation (in-process engines only, else "
    "null): unlike wall clock, it does not count waiting for a core on a shared machine",
    "model_time_speedup": "(baseline model seconds / its generated tokens) / (this run's "
    "target + draft model seconds / its generated tokens); model seconds = timed forward + "
    "compute_logits calls, engine overhead excluded",
    "matches_baseline": "fraction of requests whose generated token ids equal the baseline's "
    "(1.0 expected for lossless methods at temperature 0; sampled runs draw differently)",
    "energy_per_token_j": "NVML GPU energy over the timed run / generated_tokens (null "
    "without an NVIDIA GPU)",
}


@dataclass
class BenchOptions:
    target: str
    draft: str | None
    configs: list[tuple[str, dict[str, Any]]]  # (name, speculative config with model filled)
    prompts: PromptSet
    sampling: Sampling
    engine_overrides: dict[str, Any] = field(default_factory=dict)


def _model_summary(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    info: dict[str, Any] = {"path": str(path)}
    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        for key in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"):
            if key in cfg:
                info[key] = cfg[key]
    # Which weights were measured: two runs compare only if these hashes agree.
    weights = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if weights:
        digest = hashlib.sha256()
        for file in weights:
            with open(file, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
        info["weights_sha256"] = digest.hexdigest()
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def platform_info(energy: EnergyMeter) -> dict[str, Any]:
    """Where the numbers come from (call after an engine started: plugins are loaded)."""
    from vllm.platforms import current_platform

    device_type = getattr(current_platform, "device_type", None) or "unknown"
    info: dict[str, Any] = {"device_type": device_type, "cpu_count": os.cpu_count()}
    if device_type == "cpu":
        from vllm_specx.cpu_ops import registered_release

        release = registered_release()
        info["device_name"] = f"{_cpu_name()} ({os.cpu_count()} logical cores)"
        info["cpu_reference_ops"] = release
        suffix = " with vllm-specx's PyTorch reference ops" if release else ""
        info["description"] = f"vLLM CPU engine{suffix} on {info['device_name']}"
    else:
        name = energy.device_name
        if name is None:
            try:
                name = current_platform.get_device_name(0)
            except Exception:  # noqa: BLE001
                name = "unknown device"
        info["device_name"] = name
        info["description"] = f"vLLM {device_type} engine on {name}"
    info["energy_measured"] = energy.available
    return info


def _versions() -> dict[str, Any]:
    import torch
    import vllm

    import vllm_specx

    return {
        "vllm": getattr(vllm, "__version__", None),
        "vllm_specx": vllm_specx.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def _cross_check(metrics: dict[str, Any], counters: dict[str, Any]) -> list[str]:
    """vLLM's Prometheus counters over the same interval must agree with the traces."""
    warnings = []
    pairs = (
        ("generation_tokens", "generated_tokens"),
        ("spec_decode_num_draft_tokens", "scheduled_draft_tokens"),
        ("spec_decode_num_accepted_tokens", "accepted_tokens"),
        ("spec_decode_num_drafts", "verification_steps"),
    )
    for counter, key in pairs:
        if counter in counters and counters[counter] != metrics.get(key):
            warnings.append(
                f"vLLM counter {counter} = {counters[counter]} but the traces give "
                f"{key} = {metrics.get(key)}"
            )
    return warnings


def _entry(
    name: str,
    config: dict[str, Any] | None,
    run: RunResult,
    *,
    platform_desc: str,
    t_target: float | None,
    t_draft: float | None,
    baseline: RunResult | None,
    baseline_rate: BaselineRate | None,
    baseline_model_s: float | None,
) -> dict[str, Any]:
    drafter = DrafterStats.from_mapping(run.drafter_stats)
    draft_rec = (run.forward_times or {}).get("draft")
    draft_t = forward_time_stats(draft_rec) if draft_rec is not None else None
    per_round = (
        draft_t["calls"] / draft_t["rounds"] if draft_t and draft_t["rounds"] else None
    )
    m = config_metrics(
        run.traces,
        drafter=drafter,
        draft_forwards_per_round=per_round,
        t_target=t_target,
        t_draft=t_draft,
        wall_s=run.wall_s,
        baseline_tokens_per_s=baseline_rate.tokens_per_s if baseline_rate else None,
    )
    if config is None:
        method = "none"
        k = 0
    else:
        method = str(config.get("method") or run.resolved.get("vllm_method") or "?")
        k = run.resolved.get("num_speculative_tokens", config.get("num_speculative_tokens"))
    n = m["generated_tokens"]
    matches = None
    if baseline is not None and len(baseline.traces) == len(run.traces) and run.traces:
        same = sum(a.token_ids == b.token_ids for a, b in zip(baseline.traces, run.traces))
        matches = same / len(run.traces)
    warnings = m.pop("warnings") + _cross_check(m, run.counters)
    times = run.forward_times or {}
    target_t = forward_time_stats(times.get("target"))
    model_s = target_t["total_s"] + (draft_t["total_s"] if draft_t else 0.0)
    if not target_t["calls"]:
        model_s = None
    entry: dict[str, Any] = {
        "name": name,
        "method": method,
        "speculative_config": config,
        "num_speculative_tokens": k,
        "draft_model": (config or {}).get("model"),
        "vllm_method": run.resolved.get("vllm_method"),
        "lossless": None if config is None else not _lossy(config),
        "platform": platform_desc,
    }
    entry.update(m)
    entry.update(
        {
            "t_target_s": t_target,
            "t_draft_s": t_draft,
            "model_time_s": model_s,
            "model_time_speedup": model_time_speedup(
                baseline_model_s,
                sum(sum(t.step_tokens) for t in baseline.traces) if baseline else 0,
                model_s,
                n,
            ),
            "forward_timing": {"target": target_t, "draft": draft_t,
                               "note": run.forward_times_note},
            "cpu_s": run.cpu_s,
            "tokens_per_cpu_s": _ratio_or_none(n, run.cpu_s),
            "cpu_speedup": _cpu_speedup(run, n, baseline_rate),
            "energy_j": run.energy_j,
            "energy_per_token_j": (run.energy_j / n if run.energy_j is not None and n else None),
            "engine_start_s": run.engine_start_s,
            "matches_baseline": matches,
            "finish_reasons": dict(Counter(str(t.finish_reason) for t in run.traces)),
            "vllm_counters": run.counters,
            "drafter_stats": run.drafter_stats,
            "drafter_stats_note": run.drafter_stats_note,
            "requests_detail": [
                {
                    "generated_tokens": sum(t.step_tokens),
                    "target_forward_passes": len(t.step_tokens),
                    "drafted_tokens": sum(t.drafted_per_step),
                    "accepted_tokens": sum(t.accepted_per_step),
                    "finish_reason": t.finish_reason,
                }
                for t in run.traces
            ],
            "sample_output": run.traces[0].text if run.traces else None,
            "warnings": warnings,
        }
    )
    return entry


def _error_entry(name: str, config: dict[str, Any], platform_desc: str, exc: Exception) -> dict:
    return {
        "name": name,
        "method": str(config.get("method", "?")),
        "speculative_config": config,
        "platform": platform_desc,
        "error": f"{type(exc).__name__}: {exc}",
    }


BASELINE_AFTER = "baseline (after)"


@dataclass(frozen=True)
class BaselineRate:
    """No speculation's rate, from its runs before and after the configurations."""

    tokens_per_s: float
    tokens_per_cpu_s: float | None
    runs: list[dict[str, Any]]

    @property
    def spread(self) -> float:
        """(max - min) / mean of the runs' tokens/s: how far order and warm-up moved it."""
        rates = [r["tokens_per_s"] for r in self.runs]
        return (max(rates) - min(rates)) / self.tokens_per_s if self.tokens_per_s else 0.0


def baseline_rate(runs: list[RunResult]) -> BaselineRate:
    """The mean tokens/s (and tokens per CPU second) of the baseline's runs: every
    configuration is compared with the mean of a run before it and a run after it, so
    neither a cold first engine nor a machine that got busier favours a row."""
    described = []
    for i, run in enumerate(runs):
        n = sum(sum(t.step_tokens) for t in run.traces)
        described.append({
            "when": "before the configurations" if i == 0 else "after the configurations",
            "tokens_per_s": n / run.wall_s,
            "tokens_per_cpu_s": _ratio_or_none(n, run.cpu_s),
            "wall_s": run.wall_s,
            "cpu_s": run.cpu_s,
        })
    tps = sum(r["tokens_per_s"] for r in described) / len(described)
    cpu_rates = [r["tokens_per_cpu_s"] for r in described]
    cpu_tps = sum(cpu_rates) / len(cpu_rates) if all(cpu_rates) else None
    return BaselineRate(tps, cpu_tps, described)


def run_benchmark(opts: BenchOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run everything and return the report dict (see the module doc for the order)."""
    energy = EnergyMeter()
    prompts = opts.prompts.prompts
    common = dict(engine_overrides=opts.engine_overrides, energy=energy)
    date = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")

    try:
        log(f"[bench] baseline: {opts.target} without speculation, {len(prompts)} prompts")
        baseline = run_config(opts.target, None, prompts, opts.sampling, desc="baseline", **common)
        plat = platform_info(energy)
        plat["cpu_class"] = _cpu_class(plat, opts.engine_overrides)
        base_times = (baseline.forward_times or {}).get("target")
        target_cost = {"source": "forward timers", **forward_time_stats(base_times)}
        if target_cost["seconds"] is None:
            target_cost = {"source": FALLBACK_COST_METHOD, **forward_cost(baseline.steps)}
        t_target = target_cost["seconds"]
        baseline_model_s = forward_time_stats(base_times)["total_s"] or None
        first_tps = sum(sum(t.step_tokens) for t in baseline.traces) / baseline.wall_s
        log(f"[bench]   {first_tps:.1f} tok/s; t_target = {_f(t_target, 6)} s per forward")

        runs: list[tuple[str, dict[str, Any], RunResult | Exception]] = []
        draft_costs: dict[str, Any] = {}
        for name, cfg in opts.configs:
            log(f"[bench] {name}: {json.dumps(cfg)}")
            try:
                run = run_config(
                    opts.target, cfg, prompts, opts.sampling, desc=name,
                    drafter_stats=_is_specx(cfg), **common,
                )
            except Exception as exc:  # noqa: BLE001 - report it, run the other configs
                log(f"[bench]   failed: {type(exc).__name__}: {exc}")
                runs.append((name, cfg, exc))
                continue
            runs.append((name, cfg, run))
        # No speculation again, after every configuration: the speed-ups are against the
        # mean of both runs, and their spread is reported (docs/performance.md).
        log(f"[bench] {BASELINE_AFTER}: {opts.target} without speculation again")
        after = run_config(opts.target, None, prompts, opts.sampling, desc=BASELINE_AFTER,
                           **common)
        rate = baseline_rate([baseline, after])
        log(f"[bench]   {rate.runs[1]['tokens_per_s']:.1f} tok/s; baseline spread "
            f"{100 * rate.spread:.1f}% (speed-ups are against the mean, "
            f"{rate.tokens_per_s:.1f} tok/s)")

        def entry(name: str, cfg: dict[str, Any] | None, run: RunResult,
                  t_draft: float | None) -> dict[str, Any]:
            return _entry(name, cfg, run, platform_desc=plat["description"],
                          t_target=t_target, t_draft=t_draft, baseline=baseline,
                          baseline_rate=rate, baseline_model_s=baseline_model_s)

        entries = [entry("baseline", None, baseline, 0.0)]
        for name, cfg, result in runs:
            if isinstance(result, Exception):
                entries.append(_error_entry(name, cfg, plat["description"], result))
                continue
            if is_model_free(cfg):
                t_draft: float | None = 0.0
                draft_costs[name] = {"seconds": 0.0, "source": "model-free drafter"}
            else:
                stats = forward_time_stats((result.forward_times or {}).get("draft"))
                t_draft = stats["seconds"]
                draft_costs[name] = {"model": cfg.get("model"), "source": "forward timers",
                                     **stats}
            row = entry(name, cfg, result, t_draft)
            entries.append(row)
            log(
                f"[bench]   {name}: block efficiency {_f(row['block_efficiency'])}, t_draft "
                f"{_f(t_draft, 6)} s, projected speed-up {_f(row['projected_speedup'])}, "
                f"wall {_f(row['measured_speedup'])}x, CPU time {_f(row['cpu_speedup'])}x"
            )
        entries.append(entry(BASELINE_AFTER, None, after, 0.0))
    finally:
        energy.close()

    return {
        "schema": SCHEMA,
        "date": date,
        "versions": _versions(),
        "platform": plat,
        "models": {"target": _model_summary(opts.target), "draft": _model_summary(opts.draft)},
        "prompts": opts.prompts.describe(),
        "seeds": {
            "engine_seed": opts.engine_overrides.get("seed", _engine_default_seed()),
            "request_seed_base": opts.sampling.seed,
            "request_seeds": "request i uses seed + i",
        },
        "sampling": opts.sampling.as_dict(),
        "engine": _engine_settings(opts.engine_overrides),
        "forward_costs": {
            "method": COST_METHOD,
            "target": {"model": opts.target, **target_cost},
            "drafts": draft_costs,
        },
        "formulas": FORMULAS,
        "baseline": {
            "method": BASELINE_METHOD,
            "tokens_per_s": rate.tokens_per_s,
            "tokens_per_cpu_s": rate.tokens_per_cpu_s,
            "spread": rate.spread,
            "runs": rate.runs,
        },
        "configs": entries,
    }


def _f(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _lossy(cfg: dict[str, Any]) -> bool:
    """A specx method that does not preserve the target's distribution (mtad); vLLM's
    own methods verify by standard rejection sampling."""
    from vllm_specx.methods import METHODS

    spec = METHODS.get(str(cfg.get("method")))
    return spec is not None and not spec.lossless


def _is_specx(cfg: dict[str, Any]) -> bool:
    from vllm_specx.methods import METHODS

    return cfg.get("method") in METHODS


def _engine_default_seed() -> Any:
    from vllm_specx.engine import CPU_ENGINE_DEFAULTS

    return CPU_ENGINE_DEFAULTS.get("seed")


def _engine_settings(overrides: dict[str, Any]) -> dict[str, Any]:
    from vllm_specx.engine import engine_kwargs

    settings = engine_kwargs(**overrides)
    settings.setdefault("disable_log_stats", False)
    return {k: v for k, v in settings.items() if isinstance(v, (str, int, float, bool, type(None)))}


def _ratio_or_none(num: float, den: float | None) -> float | None:
    return num / den if den else None


def _cpu_speedup(run: RunResult, n: int, rate: BaselineRate | None) -> float | None:
    """Tokens per CPU second against the baseline's (the mean of its runs): the speed-up
    a machine with idle cores would show, read off a shared one (in-process engines
    only)."""
    if rate is None or not rate.tokens_per_cpu_s or not run.cpu_s or not n:
        return None
    return (n / run.cpu_s) / rate.tokens_per_cpu_s


def _cpu_class(plat: dict[str, Any], overrides: dict[str, Any]) -> str | None:
    """The CPU class and dtype the numbers were measured on (``cpu_host.describe``:
    AVX2 / AVX-512 / AVX512-BF16 / AMX), or None off the CPU platform."""
    if plat.get("device_type") != "cpu":
        return None
    from vllm_specx.cpu_host import describe
    from vllm_specx.engine import engine_kwargs

    return describe(str(engine_kwargs(**overrides).get("dtype")))
