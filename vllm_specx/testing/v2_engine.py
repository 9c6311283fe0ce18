"""vLLM engines on Model Runner V2 on the CPU platform, hosted in a child process.

vLLM's V2 runner runs on the CPU platform only when

* ``CUDA_VISIBLE_DEVICES`` is set and empty: ``vllm.triton_utils.importing`` decides
  ``HAS_TRITON`` once, when first imported, and with no active Triton driver it keeps
  Triton only in such a "distributed" environment (else vLLM logs "Model Runner V2
  requires Triton; using the V1 model runner instead");
* ``TRITON_INTERPRET=1``: V2's input preparation is Triton kernels, and Triton reads
  the variable when a kernel is *decorated* (``triton.jit`` -> ``InterpretedFunction``),
  i.e. when the vLLM module defining it is first imported.

Both are read once per process at import time, so a test process that already imported
vLLM for V1 engines (the rest of the suite: in-process engines, ``vllm_specx.engine``)
cannot switch. And setting them for the whole pytest session would move every other
test onto V2. Hence :class:`V2EngineHost`: one spawned child process (a fresh
interpreter: ``multiprocessing`` "spawn", environment set before it starts) that builds
engines with :func:`vllm_specx.engine.make_llm` (engine core in that same child,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and answers requests over a pipe. Several engines
may live in the host; start each once per configuration and share it.

Usage (tests/v2/conftest.py gives a session-scoped ``v2_host``)::

    host.start("eagle", target_dir, speculative_config={...})  # -> runner description
    host.generate("eagle", [[1, 2, 3], [4, 5]], {"temperature": 0, "max_tokens": 8})
    host.call("eagle", "my.module:function", arg)   # function(llm, arg) in the child
    host.stop("eagle")

Everything crossing the pipe is plain Python (lists, dicts, strings), pickled.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

# What V2 needs on the CPU platform (module doc). The rest (VLLM_TARGET_DEVICE=cpu,
# the dtype, thread binding) is inherited from the parent's environment.
V2_CPU_ENV: dict[str, str] = {
    "CUDA_VISIBLE_DEVICES": "",
    "TRITON_INTERPRET": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


class V2HostError(RuntimeError):
    """An exception raised in the child; the message carries the child's traceback."""


def runner_of(llm: Any) -> Any:
    """The model runner of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def describe_runner(llm: Any) -> dict[str, Any]:
    """Which runner, speculator and rejection sampler an engine built (class paths)."""
    runner = runner_of(llm)

    def path(obj: Any) -> str | None:
        return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"

    is_v2 = type(runner).__module__.startswith(("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu."))
    return {
        "runner": path(runner),
        "v2": is_v2,
        "speculator": path(getattr(runner, "speculator", None)),
        "drafter": path(getattr(runner, "drafter", None)),
        "rejection_sampler": path(getattr(runner, "rejection_sampler", None)),
    }


def generate_token_ids(
    llm: Any, prompts: Sequence[Sequence[int]],
    sampling: Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> list[list[int]]:
    """Token ids generated for token-id prompts; ``sampling`` is one SamplingParams dict
    for all prompts or one per prompt."""
    from vllm import SamplingParams

    if isinstance(sampling, Mapping):
        params: Any = SamplingParams(**sampling)
    else:
        params = [SamplingParams(**s) for s in sampling]
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_decode_counters(llm: Any) -> dict[str, float]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens) so far."""
    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counters[metric.name.removeprefix("vllm:spec_decode_")] = float(metric.value)
    return counters


def _resolve(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _serve(conn: Any) -> None:
    """The child's loop: (op, args) in, ("ok", result) or ("error", text) out."""
    from vllm_specx.engine import make_llm, shutdown_llm

    engines: dict[str, Any] = {}
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            break
        try:
            if op == "close":
                for llm in engines.values():
                    shutdown_llm(llm)
                engines.clear()
                conn.send(("ok", None))
                break
            if op == "start":
                key, model, kwargs = args
                if key in engines:
                    raise ValueError(f"engine {key!r} is already running")
                engines[key] = make_llm(model, **kwargs)
                result: Any = describe_runner(engines[key])
            elif op == "stop":
                shutdown_llm(engines.pop(args[0]))
                result = None
            elif op == "generate":
                key, prompts, sampling = args
                result = generate_token_ids(engines[key], prompts, sampling)
            elif op == "call":
                key, target, call_args = args
                result = _resolve(target)(engines[key] if key is not None else None,
                                          *call_args)
            elif op == "env":
                result = {k: os.environ.get(k) for k in args[0]}
            else:
                raise ValueError(f"unknown op {op!r}")
            conn.send(("ok", result))
        except Exception:  # report, keep serving
            conn.send(("error", traceback.format_exc()))


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class V2EngineHost:
    """A child process hosting vLLM engines on Model Runner V2 (module doc)."""

    def __init__(self, extra_env: Mapping[str, str] | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        env = {**V2_CPU_ENV, **(extra_env or {})}
        with _environment(env):  # a spawned child copies os.environ when it starts
            self._process = context.Process(target=_serve, args=(child_conn,),
                                            name="vllm-specx-v2-host", daemon=True)
            self._process.start()
        child_conn.close()
        self.running: dict[str, dict[str, Any]] = {}

    def _ask(self, op: str, *args: Any) -> Any:
        if not self._process.is_alive():
            raise V2HostError(f"the V2 engine host died (exit code {self._process.exitcode})")
        self._conn.send((op, args))
        try:
            status, result = self._conn.recv()
        except EOFError as err:
            raise V2HostError(
                f"the V2 engine host died during {op!r} (exit code "
                f"{self._process.exitcode})") from err
        if status == "error":
            raise V2HostError(f"in the V2 engine host, {op}{args[:2]!r}:\n{result}")
        return result

    def start(self, key: str, model: str | os.PathLike, **engine_kwargs: Any) -> dict[str, Any]:
        """Build an engine (``make_llm(model, **engine_kwargs)``) in the child; returns
        :func:`describe_runner` of it."""
        description = self._ask("start", key, str(model), engine_kwargs)
        self.running[key] = description
        return description

    def stop(self, key: str) -> None:
        self.running.pop(key, None)
        self._ask("stop", key)

    def generate(self, key: str, prompts: Sequence[Sequence[int]],
                 sampling: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[list[int]]:
        return self._ask("generate", key, [list(p) for p in prompts], sampling)

    def call(self, key: str | None, target: str, *args: Any) -> Any:
        """``target`` ("module:function") called in the child as ``function(llm, *args)``
        (``llm`` None when ``key`` is None); its result must pickle."""
        return self._ask("call", key, target, args)

    def env(self, *names: str) -> dict[str, str | None]:
        return self._ask("env", list(names))

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(Exception):
                self._ask("close")
            self._process.join(timeout=60)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=10)
        self._conn.close()


def preemption_count(llm: Any) -> float:
    """vLLM's preemption counter of an engine (``vllm:num_preemptions``)."""
    return sum(float(m.value) for m in llm.get_metrics()
               if m.name == "vllm:num_preemptions" and hasattr(m, "value"))


def generate_with_logprobs(llm: Any, prompts: Sequence[Sequence[int]],
                           sampling: Mapping[str, Any]) -> list[list[tuple[int, float]]]:
    """(token id, its logprob) of each generated token (``sampling`` must ask for
    ``logprobs``)."""
    from vllm import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                           SamplingParams(**sampling), use_tqdm=False)
    return [[(t, float(lp[t].logprob)) for t, lp in zip(o.outputs[0].token_ids,
                                                         o.outputs[0].logprobs)]
            for o in outputs]
