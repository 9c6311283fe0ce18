"""Throughput of vllm-specx's ``verify`` against vLLM's ``rejection_sample``.

Not a test: no assertions on time. Prints a markdown table.

Both sides get the same inputs (target logits, draft tokens, draft probabilities, all
requests sampled at temperature 1 with K drafts each, the standard rule) and the
timed region covers everything from logits to output tokens on each side:

* ours: softmax of the target and bonus logits, the uniforms and Exp(1) noise, then
  ``verify`` (which also samples the bonus token itself);
* vLLM: ``vllm.v1.sample.rejection_sampler.rejection_sample`` (softmax, uniforms,
  noise and recovered tokens inside; the bonus token is sampled by vLLM's Sampler
  before the call, so it is an input here and not timed).

vLLM's function runs Triton kernels. Without a GPU, vLLM finds no Triton backend and
its CPU platform swaps the kernels for ``_C::*_impl`` ops of its CPU build, which the
PyPI wheel lacks; vllm-specx's CPU reference ops (``vllm_specx.cpu_ops``, PyTorch
re-implementations of those ops) fill them in. So on CPU the vLLM column measures
vLLM's ``rejection_sample`` driving those reference ops (the script selects vLLM's
CPU platform with ``VLLM_TARGET_DEVICE=cpu``, registers the ops and installs the
platform's kernel overrides, as a vLLM worker would); where that cannot happen the
column reads "n/a" with the reason. With ``--device cuda`` the table also has our
Triton backend and vLLM runs its real Triton kernels.

    python benchmarks/bench_sampler.py [--vocab 32000] [--device cpu|cuda] [--interpret]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from collections.abc import Callable


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--interpret", action="store_true", help="TRITON_INTERPRET=1 (vLLM's kernels on CPU)"
    )
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton
if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vLLM

import torch  # noqa: E402

from vllm_specx.algorithms.verify import VerifyBatch, verify  # noqa: E402


def _timeit(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median seconds per call after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _inputs(b: int, k: int, v: int, device: str) -> dict:
    g = torch.Generator(device="cpu").manual_seed(b * 100 + k)
    t = b * k
    target_logits = torch.randn(t, v, generator=g) * 3
    draft_logits = target_logits + torch.randn(t, v, generator=g)
    draft_probs = draft_logits.softmax(-1)
    drafts = torch.multinomial(draft_probs, 1, generator=g).squeeze(1)
    bonus_logits = torch.randn(b, v, generator=g) * 3
    out = dict(
        target_logits=target_logits,
        bonus_logits=bonus_logits,
        draft_probs=draft_probs,
        drafts=drafts,
        cu=torch.arange(1, b + 1) * k,
        bonus_ids=torch.multinomial(bonus_logits.softmax(-1), 1, generator=g),
    )
    return {name: x.to(device) for name, x in out.items()}


def _ours(x: dict, b: int, k: int, verify_fn: Callable = verify) -> Callable[[], object]:
    is_greedy = torch.zeros(b, dtype=torch.bool, device=x["drafts"].device)

    def run() -> torch.Tensor:
        target = x["target_logits"].softmax(-1)
        bonus = x["bonus_logits"].softmax(-1)
        uniforms = torch.rand(b * k, device=target.device)
        noise = torch.empty_like(bonus).exponential_()
        # Built per call, greedy token from the logits, as the sampler glue does.
        batch = VerifyBatch(
            "standard", x["drafts"], x["cu"], target, bonus, is_greedy, uniforms, noise, k,
            target_argmax=x["target_logits"].argmax(-1), draft_probs=x["draft_probs"],
        )  # fmt: skip
        return verify_fn(batch)

    return run


def _setup_vllm_on_cpu() -> None:
    """What a vLLM CPU worker does before its first kernel launch."""
    from vllm.platforms import current_platform

    from vllm_specx.cpu_ops import register_cpu_reference_ops_if_needed

    if not register_cpu_reference_ops_if_needed():
        raise RuntimeError(
            f"vllm-specx CPU reference ops not active (vLLM platform "
            f"{current_platform.device_type!r}); vLLM's rejection kernels have no CPU path"
        )
    current_platform.register_triton_kernel_overrides()


def _vllm(x: dict, b: int, k: int) -> Callable[[], object]:
    from vllm.v1.sample.rejection_sampler import rejection_sample

    device = x["drafts"].device
    # rejection_sample reads only these fields of SamplingMetadata.
    metadata = types.SimpleNamespace(
        all_greedy=False,
        all_random=True,
        temperature=torch.ones(b, device=device),
        generators={},
    )
    drafts = x["drafts"].to(torch.int32)
    cu = x["cu"].to(torch.int32)

    def run() -> torch.Tensor:
        return rejection_sample(
            drafts, [k] * b, k, cu, x["draft_probs"], x["target_logits"], x["bonus_ids"],
            metadata,
        )  # fmt: skip

    return run


def main(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    columns = ["ours (torch)"]
    ours_triton = None
    if device == "cuda":
        from vllm_specx.backends.cuda import verify as ours_triton

        columns.append("ours (Triton)")
    columns.append("vLLM rejection_sample")
    vllm_setup_error = None
    if device == "cpu":
        try:
            _setup_vllm_on_cpu()
        except Exception as exc:  # noqa: BLE001 - the vLLM column then says why
            vllm_setup_error = exc
    print(
        f"device={device} vocab={args.vocab} torch={torch.__version__} "
        f"threads={torch.get_num_threads()} interpret={os.environ.get('TRITON_INTERPRET', '0')}"
    )
    print()
    print("| batch | K | " + " | ".join(f"{c} [ms]" for c in columns) + " | vLLM / ours |")
    print("|---:|---:|" + "---:|" * (len(columns) + 1))
    notes: list[str] = []
    for b in args.batch:
        for k in args.k:
            x = _inputs(b, k, args.vocab, device)
            ours = _timeit(_ours(x, b, k), device, args.repeats)
            cells = [f"{ours * 1e3:.3f}"]
            if ours_triton is not None:
                tri = _timeit(_ours(x, b, k, ours_triton), device, args.repeats)
                cells.append(f"{tri * 1e3:.3f}")
            try:
                if vllm_setup_error is not None:
                    raise vllm_setup_error
                theirs = _timeit(_vllm(x, b, k), device, args.repeats)
                cells += [f"{theirs * 1e3:.3f}", f"{theirs / ours:.2f}x"]
            except Exception as exc:  # noqa: BLE001 - report why, keep the table
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                if reason not in notes:
                    notes.append(reason)
                cells += ["n/a", "n/a"]
            print(f"| {b} | {k} | " + " | ".join(cells) + " |")
    for note in notes:
        print(f"\nvLLM's rejection_sample could not run here: {note}")
    sys.stdout.flush()


if __name__ == "__main__":
    main(ARGS)
