"""Runs the cuda backend's Triton kernels in a child process under TRITON_INTERPRET=1.

Triton decides at *import* time whether its language library is interpreted, so the
interpreter cannot be switched on inside a pytest process where something may already
have imported Triton (vLLM does), and setting it for the whole session would change
other tests (and the engines they spawn). A spawned child sets the variable before
importing anything, and the tests ship tensors to it. With a GPU the kernels run
in-process on CUDA tensors instead (see conftest ``triton_call``).

Helper module, not a test module; functions are module level so they pickle.
"""

from __future__ import annotations

import os


def init_child() -> None:
    """Process initializer: interpreter on, one thread (the box has 2 shared cores)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.set_num_threads(1)


def call(function: str, args: tuple, kwargs: dict):
    """``vllm_specx.backends.<module>.<name>(*args, **kwargs)`` for ``module:name``."""
    import importlib

    module, name = function.split(":")
    return getattr(importlib.import_module(f"vllm_specx.backends.{module}"), name)(*args, **kwargs)
