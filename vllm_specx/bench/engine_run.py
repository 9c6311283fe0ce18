"""Run one configuration through the real vLLM engine and record what happened.

One engine per configuration (started with the CPU-friendly defaults of
:mod:`vllm_specx.engine`, which are valid on any platform, plus the user's
``--engine-args``). Each run:

1. warms the engine up with every prompt, up to :data:`WARMUP_TOKENS` tokens each and
   the run's own sampling (first-call allocations, oneDNN primitives for the batch shapes
   the run meets and lazy set-up stay out of the timings and counters);
2. submits every prompt at once and drives ``LLMEngine.step()`` itself, with
   ``RequestOutputKind.DELTA`` outputs: one ``step()`` returns the outputs of one engine
   step, i.e. of one target forward, so the tokens each request received in each step are
   recorded exactly (no inference from acceptance counters, which count drafts accepted
   before the ``max_tokens`` trim);
3. takes vLLM's per-request speculative-decoding trace
   (``per_request_spec_decode_metrics="detailed"``: drafted and accepted per verification
   step), the target's log-probability of every emitted token (``logprobs=0``), the
   Prometheus spec-decode counters before and after (a cross-check), the GPU energy
   (NVML) and, for a specx drafter that has a ``specx_stats()`` method, its own counts;
4. times every forward of the target and of the drafter's model during the timed part
   (hooks installed and collected through ``collective_rpc``, see ``_ForwardTimer``), and
   counts the drafter's ``propose`` calls (drafting rounds).

On the CPU platform the engine runs in this process (``make_llm``'s default); the runner
keeps numba's thread count equal to torch's so that an ngram run cannot change the thread
count of the runs after it (``_align_numba_threads``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_specx.bench.energy import EnergyMeter
from vllm_specx.bench.metrics import RequestTrace, StepTiming, subtract_stats
from vllm_specx.glue.proposer_contract import SpecxProposer

# Prometheus names read for the cross-check (vLLM 0.32.0, vllm/v1/spec_decode/metrics.py).
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "vllm:generation_tokens",
    "vllm:prompt_tokens",
)

INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
# Tokens per prompt of the untimed warm-up generation every engine runs first.
WARMUP_TOKENS = 16


@dataclass
class Sampling:
    """The sampling settings every request of a run shares (request i gets seed + i)."""

    temperature: float
    top_k: int
    top_p: float
    max_tokens: int
    seed: int
    ignore_eos: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "per_request_seed": "seed + request index",
            "ignore_eos": self.ignore_eos,
            "logprobs": 0,
        }


@dataclass
class RunResult:
    """Raw record of one engine run (metrics are derived in :mod:`.metrics`)."""

    model: str
    speculative_config: dict[str, Any] | None
    traces: list[RequestTrace]
    steps: list[StepTiming]
    wall_s: float
    engine_start_s: float
    resolved: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)
    drafter_stats: dict[str, Any] | None = None
    drafter_stats_note: str | None = None
    energy_j: float | None = None
    # {"target": {...}, "draft": {...}}: per-call seconds of each model's forward (see
    # _ForwardTimer.close), or None when the timers could not be installed.
    forward_times: dict[str, dict[str, list[float]]] | None = None
    forward_times_note: str | None = None
    # CPU seconds this process spent in the generation (an in-process engine only: then
    # every engine and model thread is ours). On a shared machine it counts the work done,
    # not the time spent waiting for a core, which wall_s also counts.
    cpu_s: float | None = None


def _drafter_of(runner: Any) -> Any:
    """The runner's drafter: ``drafter`` on vLLM's V1 runner, ``speculator`` on Model
    Runner V2."""
    drafter = getattr(runner, "drafter", None)
    return drafter if drafter is not None else getattr(runner, "speculator", None)


def _specx_drafter_stats(worker: Any) -> dict[str, Any] | None:
    """Runs inside a worker (sent by ``collective_rpc``): the drafter's own counts."""
    inner = getattr(worker, "worker", worker)
    runner = getattr(inner, "model_runner", None)
    drafter = _drafter_of(runner)
    if not isinstance(drafter, SpecxProposer):  # vLLM's own drafter: no counts of its own
        return None
    stats = drafter.specx_stats()
    return dict(stats) if stats is not None else None


# Timers installed in a worker, by worker identity (the in-process engine shares this
# module with the benchmark; in a separate worker process it has its own copy).
_TIMERS: dict[int, dict[str, _ForwardTimer | _CallCounter]] = {}


def _num_tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in a vLLM model forward: its inputs are flattened to [num_tokens]."""
    for key in ("input_ids", "positions", "inputs_embeds"):
        value = kwargs.get(key)
        if value is not None and hasattr(value, "shape") and len(value.shape) > 0:
            return int(value.shape[-1] if key == "positions" else value.shape[0])
    for value in args:
        if hasattr(value, "shape") and len(value.shape) > 0:
            return int(value.shape[0])
    return -1


class _ForwardTimer:
    """Times every ``forward`` (hooks) and ``compute_logits`` (wrapped) of one model.

    vLLM's runners call ``model(...)`` then ``model.compute_logits(...)``; the two together
    are the model's share of a step. On CUDA the times come from CUDA events recorded on
    the current stream (no synchronisation during the run); on CPU from the wall clock,
    the forward being synchronous there. A model replayed from a CUDA graph never enters
    ``forward``: then nothing is recorded.
    """

    def __init__(self, module: Any) -> None:
        import torch

        self.module = module
        first = next(iter(module.parameters()), None)
        self.cuda = bool(first is not None and first.is_cuda and torch.cuda.is_available())
        self.forward: list[tuple[Any, Any, int]] = []
        self.logits: list[tuple[Any, Any]] = []
        self._pending: tuple[Any, int] | None = None
        self.threads: set[int] = set()
        # vLLM's @support_torch_compile replaces __call__ and, when not compiling, calls
        # self.forward directly, so module hooks never fire (e.g. DeepSeekMTP, the drafter
        # of mtp/specx_mtp): such a model gets its forward wrapped (an instance attribute
        # that close() deletes) instead of hooks.
        self._wrapped_forward = type(module).__call__ is not torch.nn.Module.__call__
        self._handles = []
        if self._wrapped_forward:
            original_forward = module.forward

            def timed_forward(*args: Any, **kwargs: Any) -> Any:
                self._pre(module, args, kwargs)
                out = original_forward(*args, **kwargs)
                self._post(module, args, kwargs, out)
                return out

            module.forward = timed_forward
        else:
            self._handles = [
                module.register_forward_pre_hook(self._pre, with_kwargs=True),
                module.register_forward_hook(self._post, with_kwargs=True),
            ]
        self._wrapped = False
        original = getattr(module, "compute_logits", None)
        if callable(original):
            def timed_compute_logits(*args: Any, **kwargs: Any) -> Any:
                start = self._mark()
                out = original(*args, **kwargs)
                self.logits.append((start, self._mark()))
                return out

            # An instance attribute shadows the method until close() deletes it.
            module.compute_logits = timed_compute_logits
            self._wrapped = True

    def _mark(self) -> Any:
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        # Intra-op threads in force: timings are comparable only under the same count.
        self.threads.add(torch.get_num_threads())
        self._pending = (self._mark(), _num_tokens(args, kwargs))

    def _post(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if self._pending is not None:
            start, tokens = self._pending
            self.forward.append((start, self._mark(), tokens))
            self._pending = None

    def _seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start

    def close(self) -> dict[str, list[float]]:
        for handle in self._handles:
            handle.remove()
        if self._wrapped_forward:
            with contextlib.suppress(AttributeError):
                del self.module.forward
        if self._wrapped:
            with contextlib.suppress(AttributeError):
                del self.module.compute_logits
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return {
            "forward_s": [self._seconds(s, e) for s, e, _ in self.forward],
            "tokens": [float(n) for _, _, n in self.forward],
            "logits_s": [self._seconds(s, e) for s, e in self.logits],
            "torch_threads": sorted(float(t) for t in self.threads),
        }


class _CallCounter:
    """Counts calls of one bound method (the drafter's ``propose``: one drafting round of
    the batch), through an instance attribute that ``close()`` deletes again."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name, self.calls = owner, name, 0
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def close(self) -> int:
        with contextlib.suppress(AttributeError):
            delattr(self.owner, self.name)
        return self.calls


def _unwrap(module: Any) -> Any:
    # CUDA-graph wrappers hold the real module; hooks go on that one.
    unwrap = getattr(module, "unwrap", None)
    return unwrap() if callable(unwrap) else module


def _install_forward_timers(worker: Any) -> list[str]:
    """Runs inside a worker: hook the target model and, if any, the drafter's model."""
    import torch

    inner = getattr(worker, "worker", worker)
    runner = inner.model_runner
    timers: dict[str, _ForwardTimer | _CallCounter] = {}
    get_model = getattr(runner, "get_model", None)
    target = get_model() if callable(get_model) else getattr(runner, "model", None)
    if isinstance(target, torch.nn.Module):
        timers["target"] = _ForwardTimer(target)
    drafter = _drafter_of(runner)
    draft = getattr(drafter, "model", None)
    if draft is not None:
        draft = _unwrap(draft)
        if isinstance(draft, torch.nn.Module) and draft is not target:
            timers["draft"] = _ForwardTimer(draft)
            if callable(getattr(drafter, "propose", None)):
                timers["rounds"] = _CallCounter(drafter, "propose")
    _TIMERS[id(inner)] = timers
    return sorted(timers)


def _collect_forward_timers(worker: Any) -> dict[str, dict[str, list[float]]]:
    """Runs inside a worker: remove the timers and return what they recorded."""
    inner = getattr(worker, "worker", worker)
    timers = _TIMERS.pop(id(inner), {})
    out: dict[str, Any] = {name: timer.close() for name, timer in timers.items()}
    if "draft" in out:
        out["draft"]["rounds"] = [float(out.pop("rounds", 0))]
    return out


def read_drafter_stats(llm: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The first worker's ``drafter.specx_stats()``, or (None, reason)."""
    try:
        results = llm.collective_rpc(_specx_drafter_stats, timeout=60)
    except Exception as exc:  # noqa: BLE001 - optional: never fail a run over it
        return None, f"drafter stats not read: {type(exc).__name__}: {exc}"
    first = results[0] if results else None
    if first is None:
        return None, "the drafter has no specx_stats()"
    return first, None


def read_counters(llm: Any) -> dict[str, Any]:
    """Current values of :data:`SPEC_COUNTERS` (summed over engines)."""
    out: dict[str, Any] = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - stats disabled
        return out
    for m in metrics:
        if m.name not in SPEC_COUNTERS:
            continue
        key = m.name.removeprefix("vllm:")
        values = getattr(m, "values", None)
        if isinstance(values, list):
            prev = out.get(key, [])
            width = max(len(prev), len(values))
            out[key] = [
                (prev[i] if i < len(prev) else 0) + (values[i] if i < len(values) else 0)
                for i in range(width)
            ]
        else:
            value = getattr(m, "value", None)
            if isinstance(value, (int, float)):
                out[key] = out.get(key, 0) + value
    return out


def resolved_speculative_config(llm: Any) -> dict[str, Any]:
    """What vLLM made of the speculative config (method, K, draft model)."""
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    spec = getattr(cfg, "speculative_config", None)
    if spec is None:
        return {}
    draft_cfg = getattr(spec, "draft_model_config", None)
    return {
        "vllm_method": getattr(spec, "method", None),
        "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None),
        "draft_model": getattr(draft_cfg, "model", None) if draft_cfg is not None else None,
    }


def _sampling_params(sampling: Sampling, seed: int, *, delta: bool) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        seed=seed,
        ignore_eos=sampling.ignore_eos,
        logprobs=0,
        output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
    )


def _timed_generation(
    llm: Any, prompts: list[str], sampling: Sampling, desc: str
) -> tuple[list[RequestTrace], list[StepTiming], float, float]:
    """Submit all prompts, step the engine to completion, record every step. Returns the
    traces, the steps, and the wall and CPU seconds of the same interval (the imports and
    set-up above it, paid once per process, are in neither: they would land on the first
    engine's row only)."""
    from tqdm.auto import tqdm

    params = [_sampling_params(sampling, sampling.seed + i, delta=True)
              for i in range(len(prompts))]
    traces = [RequestTrace(step_tokens=[]) for _ in prompts]
    steps: list[StepTiming] = []
    engine = llm.llm_engine
    bar = tqdm(
        total=len(prompts) * sampling.max_tokens,
        desc=desc,
        unit="tok",
        leave=False,
        dynamic_ncols=True,
        disable=None,  # on for a terminal, off in logs and CI
    )
    start = time.perf_counter()
    cpu_start = time.process_time()
    # Our own request ids: outputs carry the id given here (the engine keeps an internal
    # suffixed one to itself).
    index: dict[str, int] = {}
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        rid = f"specx-bench-{i}"
        index[rid] = i
        engine.add_request(rid, prompt, param)
    last = start
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            emitted = 0
            prefill = False
            for out in outputs:
                i = index[str(out.request_id)]
                tr = traces[i]
                comp = out.outputs[0]
                new = list(comp.token_ids)
                if new:
                    if not tr.step_tokens:
                        prefill = True
                    tr.step_tokens.append(len(new))
                    tr.token_ids.extend(new)
                    tr.text += comp.text or ""
                    emitted += 1
                    bar.update(len(new))
                    lps = comp.logprobs or []
                    for pos, tok in enumerate(new):
                        entry = lps[pos] if pos < len(lps) else None
                        lp = entry.get(tok) if entry else None
                        tr.logprobs.append(float(lp.logprob) if lp is not None else None)
                if out.finished:
                    tr.finish_reason = comp.finish_reason
                    sdm = getattr(comp, "spec_decode_metrics", None)
                    if sdm is not None:
                        tr.drafted_per_step = list(sdm.per_step_drafted)
                        tr.accepted_per_step = list(sdm.per_step_accepted)
            if emitted:
                steps.append(StepTiming(seconds=now - last, prefill=prefill, requests=emitted))
                last = now
    finally:
        bar.close()
    wall = time.perf_counter() - start
    return traces, steps, wall, time.process_time() - cpu_start


def _start_llm(model: str, overrides: dict[str, Any]) -> Any:
    """An engine with the project's small defaults. On the CPU platform through
    ``make_llm`` (its process settings: in-process engine, one torch thread); elsewhere
    ``vllm.LLM`` directly, since ``make_llm`` would select the CPU platform."""
    from vllm_specx.engine import engine_kwargs, make_llm

    if os.environ.get("VLLM_TARGET_DEVICE", "cpu") == "cpu" and not _gpu_platform():
        return make_llm(model, **overrides)
    from vllm import LLM

    return LLM(model=str(model), **engine_kwargs(**overrides))


def _gpu_platform() -> bool:
    """True when VLLM_TARGET_DEVICE is unset and an NVIDIA GPU is visible to NVML."""
    if "VLLM_TARGET_DEVICE" in os.environ:
        return False
    meter = EnergyMeter()
    try:
        return meter.available
    finally:
        meter.close()


def _in_process(llm: Any) -> bool:
    """True when the engine core runs in this process (vLLM's ``InprocClient``)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return type(core).__name__ == "InprocClient"


def _align_numba_threads() -> None:
    """Keep an in-process engine's torch thread count the same in every run.

    vLLM's ngram proposer sets numba's thread count for each call and then restores the
    count it found; with numba's OpenMP layer that restored count becomes the OpenMP
    thread count of the calling thread, which in an in-process engine is the thread that
    runs every later torch op, in later engines too. Left alone, the first ngram run turns
    a one-thread process into a two-thread one, and the configurations after it are timed
    under different conditions from those before. Pinning numba's count to torch's makes
    the restore a no-op.
    """
    import torch

    threads = torch.get_num_threads()
    numba = sys.modules.get("numba")
    if numba is None:
        # Read when numba is first imported (by the ngram proposer).
        os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))
        return
    with contextlib.suppress(Exception):
        numba.set_num_threads(min(threads, int(numba.config.NUMBA_NUM_THREADS)))


def run_config(
    model: str,
    speculative_config: dict[str, Any] | None,
    prompts: list[str],
    sampling: Sampling,
    *,
    engine_overrides: dict[str, Any] | None = None,
    desc: str = "bench",
    energy: EnergyMeter | None = None,
    drafter_stats: bool = False,
) -> RunResult:
    """Start an engine for ``model`` (with ``speculative_config``), run, shut it down."""
    from vllm_specx.engine import shutdown_llm

    overrides = dict(engine_overrides or {})
    overrides.setdefault("disable_log_stats", False)
    if speculative_config is not None:
        overrides["speculative_config"] = dict(speculative_config)
        overrides.setdefault("per_request_spec_decode_metrics", "detailed")
    # collective_rpc with a function (forward timers, drafter stats) is pickled across the
    # engine's processes when it has several, which vLLM allows only with this switch
    # (local IPC of the benchmark's own engine).
    os.environ.setdefault(INSECURE_SERIALIZATION_ENV, "1")
    t0 = time.perf_counter()
    llm = _start_llm(model, overrides)
    if _in_process(llm):
        _align_numba_threads()
    engine_start_s = time.perf_counter() - t0
    try:
        resolved = resolved_speculative_config(llm)
        # Warm-up, not counted: every prompt together with the run's own sampling, so the
        # batch shapes, prefill chunks and sampler paths the timed run meets have met
        # their first-call costs (allocations, oneDNN primitives, lazy set-up) here.
        warm = _sampling_params(
            Sampling(sampling.temperature, sampling.top_k, sampling.top_p,
                     min(WARMUP_TOKENS, sampling.max_tokens), sampling.seed,
                     sampling.ignore_eos),
            sampling.seed, delta=False,
        )
        llm.generate(prompts, warm, use_tqdm=False)
        if _in_process(llm):
            _align_numba_threads()  # again: the warm-up may have run the ngram proposer
        # The timed run's prompts are new to the engine, as a user's are: the warm-up
        # filled the prefix cache with exactly these prompts, which made the baseline's
        # prefill nearly free while vLLM (0.32) recomputes the last cached block of every
        # prompt for an EAGLE-style drafter (the head needs that block's hidden states).
        # On the real pair at batch 32 that alone cost an EAGLE-3 row 7% of its target
        # time against the baseline's, with no draft verified.
        llm.reset_prefix_cache()
        counters_before = read_counters(llm)
        stats_before, note = read_drafter_stats(llm) if drafter_stats else (None, None)
        timers_note = None
        try:
            llm.collective_rpc(_install_forward_timers, timeout=60)
        except Exception as exc:  # noqa: BLE001 - costs then come from engine steps
            timers_note = f"forward timers not installed: {type(exc).__name__}: {exc}"
        if energy is not None:
            energy.start()
        traces, steps, wall, cpu = _timed_generation(llm, prompts, sampling, desc)
        cpu_s = cpu if _in_process(llm) else None
        energy_j = energy.stop() if energy is not None else None
        forward_times = None
        if timers_note is None:
            try:
                forward_times = llm.collective_rpc(_collect_forward_timers, timeout=60)[0]
            except Exception as exc:  # noqa: BLE001
                timers_note = f"forward timers not read: {type(exc).__name__}: {exc}"
        counters_after = read_counters(llm)
        stats_after, note_after = read_drafter_stats(llm) if drafter_stats else (None, None)
        from vllm_specx.bench.metrics import counter_delta

        return RunResult(
            model=str(model),
            speculative_config=speculative_config,
            traces=traces,
            steps=steps,
            wall_s=wall,
            engine_start_s=engine_start_s,
            resolved=resolved,
            counters=counter_delta(counters_before, counters_after),
            drafter_stats=subtract_stats(stats_before, stats_after),
            drafter_stats_note=note_after or note,
            energy_j=energy_j,
            forward_times=forward_times,
            forward_times_note=timers_note,
            cpu_s=cpu_s,
        )
    finally:
        with contextlib.suppress(Exception):
            shutdown_llm(llm)
