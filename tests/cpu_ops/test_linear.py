"""The ``cpu_onednn_packed_linear`` patch: oneDNN's prepacked linear against F.linear.

vLLM's own ``dispatch_cpu_unquantized_gemm`` is wrapped (not applied process-wide) and
called on real layers; no engine starts here (tests/engine/test_default_dtype.py checks
the engine's layers).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_specx import cpu_host
from vllm_specx.cpu_ops import linear

ROWS = (0, 1, 3, 9, 24)


def _packable_here(dtype: torch.dtype):
    """The dtypes oneDNN packs on this CPU run; the others are skipped with the reason (the
    fallback they get is checked by the tests that simulate such a CPU, below)."""
    return pytest.param(dtype, id=str(dtype), marks=pytest.mark.skipif(
        not linear.onednn_packs(dtype),
        reason=f"oneDNN cannot pack {dtype} on this {cpu_host.cpu_class()} CPU; "
               "test_a_cpu_that_cannot_pack_keeps_vllms_linear covers the fallback"))


PACKABLE_HERE = [_packable_here(dtype) for dtype in linear.PACKED_DTYPES]


def _weight(dtype: torch.dtype, out_features: int = 96, in_features: int = 64):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype)
    return w, b


@pytest.mark.parametrize("dtype", PACKABLE_HERE)
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(dtype, with_bias):
    w, b = _weight(dtype)
    bias = b if with_bias else None
    fn = linear.packed_linear(w)
    assert fn is not None
    gen = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, w.shape[1], generator=gen).to(dtype)
        got, want = fn(x, w, bias), F.linear(x, w, bias)
        assert got.shape == want.shape and got.dtype == want.dtype
        if dtype == torch.bfloat16 and (rows == 0 or rows >= linear.MIN_ROWS):
            # torch's bfloat16 F.linear is oneDNN's too: bit-identical (fewer rows are
            # padded to MIN_ROWS, which F.linear does not do).
            assert torch.equal(got, want), rows
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, w.shape[1], generator=gen).to(dtype)  # leading batch dims
    torch.testing.assert_close(fn(x3, w, bias), F.linear(x3, w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", PACKABLE_HERE)
def test_a_row_does_not_depend_on_how_many_rows_share_the_call(dtype):
    # Verification runs K + 1 rows where decoding runs one: the same row must give the
    # same numbers, or greedy speculation could drift from plain decoding.
    # 1536 inputs: SmolLM2's down projection, where oneDNN's few-row kernel sums in
    # another order (unpadded, 1-3 rows differed from 4 and more in bfloat16).
    w, _ = _weight(dtype, 576, 1536)
    fn = linear.packed_linear(w)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(2)).to(dtype)
    full = fn(x, w, None)
    for rows in range(1, 25):
        for first in (0, 7):
            got = fn(x[first:first + rows], w, None)
            assert torch.equal(got, full[first:first + rows]), (rows, first)


def test_other_dtypes_and_shapes_are_not_packed():
    assert linear.packed_linear(torch.zeros(4, 4, dtype=torch.float64)) is None
    assert linear.packed_linear(torch.zeros(4, 4, 4, dtype=torch.bfloat16)) is None


def _layer(weight: torch.Tensor) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    layer.bias = None
    return layer


def _dispatch():
    from vllm.model_executor.layers import utils

    original = getattr(utils.dispatch_cpu_unquantized_gemm, "__specx_original__",
                       utils.dispatch_cpu_unquantized_gemm)
    return linear.OneDnnPackedLinear().wrap(original)


@pytest.mark.parametrize("dtype", PACKABLE_HERE)
@pytest.mark.parametrize("remove_weight", [True, False])
def test_patched_dispatch_gives_layers_the_packed_linear(dtype, remove_weight):
    w, _ = _weight(dtype)
    layer = _layer(w)
    _dispatch()(layer, remove_weight)
    assert "packed_linear" in layer.cpu_linear.__qualname__
    # Like vLLM's own oneDNN path: the weight is dropped only when vLLM asks.
    assert layer.weight.numel() == (0 if remove_weight else w.numel())
    x = torch.randn(5, w.shape[1]).to(dtype)
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), F.linear(x, w),
                               rtol=1e-5, atol=1e-5)


def test_dtypes_it_cannot_pack_and_the_switch_keep_vllms_linear(monkeypatch):
    w, _ = _weight(torch.float64)
    layer = _layer(w)
    _dispatch()(layer, True)
    assert "packed_linear" not in layer.cpu_linear.__qualname__
    x = torch.randn(3, w.shape[1], dtype=torch.float64)
    assert torch.equal(layer.cpu_linear(x, layer.weight, None), F.linear(x, w))

    monkeypatch.setenv(linear.PLAIN_LINEAR_ENV, "1")
    layer = _layer(_weight(torch.bfloat16)[0])
    _dispatch()(layer, False)
    assert "packed_linear" not in layer.cpu_linear.__qualname__


def test_a_cpu_that_cannot_pack_keeps_vllms_linear(monkeypatch):
    # An AVX2-only CPU, simulated: oneDNN computes no bfloat16 there. bfloat16 weights are
    # not packed and keep vLLM's choice, which gives F.linear's numbers; float32 is packed.
    monkeypatch.setattr(cpu_host, "onednn_bf16", lambda: False)
    assert not linear.onednn_packs(torch.bfloat16) and linear.onednn_packs(torch.float32)
    w, _ = _weight(torch.bfloat16)
    assert linear.packed_linear(w) is None
    layer = _layer(w)
    _dispatch()(layer, True)
    assert "packed_linear" not in layer.cpu_linear.__qualname__
    x = torch.randn(3, w.shape[1]).to(torch.bfloat16)
    assert torch.equal(layer.cpu_linear(x, layer.weight, None), F.linear(x, w))
    assert linear.packed_linear(_weight(torch.float32)[0]) is not None


def test_vllms_sgl_choice_without_its_compiled_op_falls_back_to_f_linear(monkeypatch):
    # An AMX CPU, simulated on any host: vLLM gives small bfloat16 weights its sgl kernel,
    # whose packing op the PyPI wheel lacks; the layer gets vLLM's F.linear fallback
    # instead of dying at load (here reached through the plain-linear switch).
    from vllm.model_executor.layers import utils

    monkeypatch.setattr(utils, "check_cpu_sgl_kernel", lambda n, k, dtype: True)
    monkeypatch.setenv(linear.PLAIN_LINEAR_ENV, "1")
    w, _ = _weight(torch.bfloat16)
    layer = _layer(w)
    _dispatch()(layer, True)
    x = torch.randn(4, w.shape[1]).to(torch.bfloat16)
    assert torch.equal(layer.cpu_linear(x, layer.weight, None), F.linear(x, w))
    assert layer.weight.numel() == w.numel()  # F.linear needs the weight
