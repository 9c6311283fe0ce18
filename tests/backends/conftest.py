"""Fixtures that run every backend's ``verify`` on this CPU-only machine.

* ``cpu``: the torch path, directly.
* ``npu``: the same module vLLM-Ascend would load, with a fake ``torch_npu`` in
  ``sys.modules`` (a MagicMock, as vLLM-Ascend's unit tests do); the fixture then
  asserts the fake was never called: the NPU path is plain torch.
* ``cuda``: the Triton kernels. With a GPU, on CUDA tensors; without one, in a spawned
  child process under ``TRITON_INTERPRET=1`` (see ``triton_interpret_worker``).

Also puts ``tests/algorithms`` on ``sys.path`` for the shared ``verify_reference``.
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest.mock import MagicMock

import pytest
import torch

_HERE = Path(__file__).resolve().parent
for _path in (str(_HERE.parent / "algorithms"), str(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import triton_interpret_worker  # noqa: E402

from vllm_specx.algorithms.verify import VerifyBatch  # noqa: E402

BACKEND_NAMES = ("cpu", "npu", "cuda")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: OpenMP threads on 2 shared cores only add spin-waiting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _move(value, device: str):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, VerifyBatch):
        tensors = {
            f.name: getattr(value, f.name).to(device)
            for f in dataclasses.fields(value)
            if isinstance(getattr(value, f.name), torch.Tensor)
        }
        return dataclasses.replace(value, **tensors)
    return value


@pytest.fixture(scope="session")
def triton_call() -> Iterator[Callable]:
    """``triton_call("module:function", *args, **kwargs)`` runs a Triton entry point.

    Results come back as CPU tensors (tuples of tensors stay tuples).
    """
    pytest.importorskip("triton")
    if torch.cuda.is_available():

        def direct(function: str, *args, **kwargs):
            args = tuple(_move(a, "cuda") for a in args)
            kwargs = {k: _move(v, "cuda") for k, v in kwargs.items()}
            result = triton_interpret_worker.call(function, args, kwargs)
            if isinstance(result, tuple):
                return tuple(r.cpu() for r in result)
            return result.cpu()

        yield direct
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=1, mp_context=context, initializer=triton_interpret_worker.init_child
    ) as pool:

        def remote(function: str, *args, **kwargs):
            return pool.submit(triton_interpret_worker.call, function, args, kwargs).result()

        yield remote


@pytest.fixture
def fake_torch_npu(monkeypatch: pytest.MonkeyPatch) -> MagicMock:
    """A MagicMock standing in for torch_npu (removed again after the test)."""
    fake = MagicMock(name="torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


@pytest.fixture(params=BACKEND_NAMES)
def backend_verify(request: pytest.FixtureRequest) -> Iterator[tuple[str, Callable]]:
    """(name, verify) for each backend, runnable here: ``verify(batch) -> tokens``."""
    name = request.param
    if name == "cuda":
        call = request.getfixturevalue("triton_call")

        def verify(batch: VerifyBatch) -> torch.Tensor:
            return call("cuda:verify", batch)

        yield name, verify
        return
    fake = request.getfixturevalue("fake_torch_npu") if name == "npu" else None
    module = importlib.import_module(f"vllm_specx.backends.{name}")
    yield name, module.BACKEND.verify
    if fake is not None:
        assert fake.mock_calls == [], f"the npu path called torch_npu: {fake.mock_calls}"
