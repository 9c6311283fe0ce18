"""The runtime fixes of vLLM's kernel-override registration (defect 3 in the docs)."""

from __future__ import annotations

import sys
import types

import pytest

pytestmark = pytest.mark.usefixtures("reference_ops")


class _DictLiar:
    """Like llvmlite's ``_lib_wrapper``: ``__dict__`` is served by ``__getattr__`` and
    is not a mapping."""

    __slots__ = ()

    def __getattr__(self, name):
        return lambda *a: None


def test_register_kernels_survives_objects_without_a_real_dict(monkeypatch):
    from vllm.triton_utils import dispatcher

    def kern(x_ptr, n):  # stands in for a Triton kernel
        raise AssertionError("the original must have been replaced")

    defining = types.ModuleType("specx_fake_kernels")
    defining.kern = kern
    user = types.ModuleType("specx_fake_user")
    user.kern = kern  # a ``from specx_fake_kernels import kern`` copy
    liar = types.ModuleType("specx_fake_llvmlite")
    liar.lib = _DictLiar()
    for mod in (defining, user, liar):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(dispatcher, "_registry", dict(dispatcher._registry))

    calls = []
    dispatcher.register_kernels({"specx_fake_kernels.kern": lambda x_ptr, n: calls.append(n)})
    defining.kern[(1,)](x_ptr=None, n=3)
    user.kern[(1,)](x_ptr=None, n=4)  # the copy was rebound too
    assert calls == [3, 4]


def test_platform_registers_its_overrides_once(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    calls = []
    monkeypatch.setattr(dispatcher, "register_kernels", lambda overrides: calls.append(1))
    current_platform.register_triton_kernel_overrides()  # already done by the fixture
    assert calls == []
