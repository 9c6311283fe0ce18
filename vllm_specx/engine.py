"""Engine start-up: vLLM's real engine with small defaults that suit a CPU host.

Product code, used by ``vllm-specx bench`` (and the coming training-data commands) as
well as by the tests and examples. Scripts need an ``if __name__ == "__main__":`` guard
(vLLM may spawn processes)::

    from vllm_specx.engine import make_llm, shutdown_llm
    llm = make_llm(model_dir, speculative_config={"method": "ngram", ...})
    ...
    shutdown_llm(llm)

Engine defaults (:data:`CPU_ENGINE_DEFAULTS`, each overridable by keyword): the dtype of
:func:`default_dtype` (bfloat16 on a CPU with native bfloat16 arithmetic, else float32),
eager mode (no compilation), a 64 MiB KV cache (the CPU worker otherwise insists on
reserving 92% of the memory node at start-up), 32-token KV blocks (the smallest block
size CPU attention accepts), a fixed seed.

Environment: :func:`ensure_cpu_env` sets ``VLLM_TARGET_DEVICE=cpu`` (process-wide;
vLLM picks its platform when first imported). :func:`make_llm` applies
:data:`ENGINE_ENV_DEFAULTS` to variables that are unset, only while the engine is
being built (vLLM reads them then), and restores them afterwards:

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` -- run engine core and worker inside the
  calling process. On a small shared machine this starts an engine in a few seconds
  instead of tens (no process spawns) and avoids the busy-polling of vLLM's
  inter-process queues. Several engines may live in one process. Export it as ``1``
  to get vLLM's normal process layout.
* ``VLLM_CPU_OMP_THREADS_BIND=nobind`` -- do not pin threads to cores.

For in-process engines :func:`make_llm` also sets torch to ``torch_threads`` (default
1) intra-op threads before the first engine: tiny models are overhead-bound, and
several OpenMP threads on a busy 2-core box make each op wait for a descheduled
thread. In-process engines change the calling process the way a vLLM worker changes
its own: vLLM seeds the global RNGs, replaces ``torch.set_num_threads`` with a no-op
(thread binding), and caches all ``VLLM_*`` environment variables while an engine
runs (:func:`shutdown_llm` clears that cache again) -- so shut engines down when done.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

MiB = 1 << 20

CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 * MiB,
    "block_size": 32,
    "max_model_len": 512,
    "max_num_seqs": 8,
    "seed": 0,
}


ENGINE_ENV_DEFAULTS: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


# Overrides :func:`default_dtype` (any dtype vLLM accepts); the test suite sets float32,
# the dtype its transformers references run in.
DTYPE_ENV = "VLLM_SPECX_CPU_DTYPE"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX, with oneDNN
    computing bfloat16), which is where torch's oneDNN bfloat16 linear beats float32
    (:func:`vllm_specx.cpu_host.native_bf16`)."""
    from vllm_specx.cpu_host import native_bf16

    return native_bf16()


def default_dtype() -> str:
    """The engines' dtype unless a caller passes one: ``$VLLM_SPECX_CPU_DTYPE`` if set;
    else, on vLLM's CPU platform, bfloat16 where the CPU has native bfloat16 arithmetic
    (there a decoding step costs about half of float32's and verifying 2-9 tokens
    little more than one: docs/benchmarks/real-pair.md, "Can speculation pay on this CPU?");
    else float32.

    Greedy equality of lossless speculation holds within one dtype, up to exact ties of
    two logits at that dtype's precision (docs/methods/index.md: more likely in
    bfloat16); bfloat16 changes the target's own outputs slightly
    (docs/benchmarks/real-pair.md: the perplexity of each dtype's text)."""
    chosen = os.environ.get(DTYPE_ENV, "").strip()
    if chosen:
        return chosen
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" and cpu_has_native_bf16():
        return "bfloat16"
    return "float32"


def ensure_cpu_env() -> None:
    """Select vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu`` unless already set).

    Call before vLLM is imported: vLLM resolves its platform once, on first use. On an
    AMX CPU it also caps oneDNN's ISA (:func:`vllm_specx.cpu_host.cap_onednn_isa_for_exact_rows`)
    before anything in the process can run a oneDNN product (the plugin's registration does
    it again, too late for a process that multiplied bfloat16 before starting an engine).
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if os.environ["VLLM_TARGET_DEVICE"] == "cpu":
        from vllm_specx.cpu_host import cap_onednn_isa_for_exact_rows

        cap_onednn_isa_for_exact_rows()


@contextlib.contextmanager
def _engine_env() -> Iterator[dict[str, str]]:
    """:data:`ENGINE_ENV_DEFAULTS` for unset variables, restored on exit."""
    added = {k: v for k, v in ENGINE_ENV_DEFAULTS.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield {k: os.environ[k] for k in ENGINE_ENV_DEFAULTS}
    finally:
        for key in added:
            os.environ.pop(key, None)


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    """:data:`CPU_ENGINE_DEFAULTS` and :func:`default_dtype` updated with ``overrides``."""
    kwargs = dict(CPU_ENGINE_DEFAULTS)
    kwargs["dtype"] = default_dtype()
    kwargs.update(overrides)
    return kwargs


def _set_torch_threads(n: int) -> None:
    import torch

    if torch.get_num_threads() != n:
        # After an in-process engine, vLLM has swapped torch.set_num_threads for a
        # no-op that warns; the thread count chosen before the first engine stays.
        torch.set_num_threads(n)


def make_llm(model: str | os.PathLike, *, torch_threads: int | None = 1, **overrides: Any):
    """A ``vllm.LLM`` for ``model`` with CPU-friendly defaults (see module doc)."""
    ensure_cpu_env()
    with _engine_env() as env:
        if torch_threads is not None and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
            _set_torch_threads(torch_threads)
        from vllm import LLM

        return LLM(model=str(model), **engine_kwargs(**overrides))


def shutdown_llm(llm: Any) -> None:
    """Stop an engine now rather than at interpreter exit, so tests can start engines
    one after another on a small machine."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    with contextlib.suppress(Exception):
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    del llm, engine, core
    gc.collect()
    with contextlib.suppress(Exception):
        from vllm import envs

        envs.disable_envs_cache()


@contextlib.contextmanager
def running_llm(model: str | os.PathLike, **overrides: Any) -> Iterator[Any]:
    """``with running_llm(path) as llm: ...`` -- shut down on exit."""
    llm = make_llm(model, **overrides)
    try:
        yield llm
    finally:
        shutdown_llm(llm)
