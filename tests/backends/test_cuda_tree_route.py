"""Draft trees on CUDA, the engine side (issue 34): vLLM's real ``TritonAttentionImpl.forward``
as the ``triton_attention_tree_route`` patch leaves it, the before-start decisions for a
tree config on CUDA (TRITON_ATTN, eager, one line), and the device refusals.

* With the tree step's masks set (``cpu_ops.attention.query_masks``, what the V1 tree
  step sets around the target's forward) the patched forward writes, into the layer's
  own output rows, the tree attention of the path-as-chain reference, padding rows
  untouched; vLLM's ``unified_attention`` is not called.
* With no masks set it is vLLM's own forward: on CPU, ``unified_attention`` (which the
  Triton interpreter cannot run usefully here) is replaced by a recorder and gets the
  same arguments, objects and all, as from the unpatched forward; on a GPU the two
  outputs are compared bit for bit.

On CPU the tree kernel runs in the ``triton_call`` child under ``TRITON_INTERPRET=1``
(the rest of the forward in this process); on a GPU everything runs on CUDA tensors.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_tree_attention_kernel import make_batch, slow_reference

from vllm_specx.config import SpecxConfigError
from vllm_specx.cpu_ops.attention import QueryMasks, query_masks

pytest.importorskip("triton")

from vllm_specx.glue.cuda_tree_attention import (  # noqa: E402
    TritonTreeRoute,
    prepare_cuda_tree_engine,
    tree_config_refusal,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, HEAD = 8, 2, 32


@pytest.fixture(scope="module")
def triton_attn():
    """vLLM's triton_attn module with the route patch applied (as the plugin applies it
    when vLLM imports the module; idempotent)."""
    import vllm.v1.attention.backends.triton_attn as module

    TritonTreeRoute().apply()
    assert module.TritonAttentionImpl.forward.__specx_patch__ == "triton_attention_tree_route"
    return module


def _layer_inputs(triton_attn, b: dict, pad: int):
    """A real impl, metadata, layer scales, query (with ``pad`` CUDA-graph padding rows)
    and a NaN output buffer, on DEVICE."""
    n = b["query"].shape[0]
    impl = triton_attn.TritonAttentionImpl(
        num_heads=HEADS, head_size=HEAD, scale=HEAD ** -0.5, num_kv_heads=KV_HEADS,
        alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    scratch = torch.empty(0, device=DEVICE)
    metadata = triton_attn.TritonAttentionMetadata(
        num_actual_tokens=n, max_query_len=max(b["q_lens"]),
        query_start_loc=b["qsl"].to(DEVICE), max_seq_len=int(b["seq_lens"].max()),
        seq_lens=b["seq_lens"].to(DEVICE), block_table=b["table"].to(DEVICE),
        slot_mapping=scratch, seq_threshold_3D=0, num_par_softmax_segments=16,
        softmax_segm_output=scratch, softmax_segm_max=scratch, softmax_segm_expsum=scratch,
        causal=True)
    one = torch.ones((), device=DEVICE)
    layer = SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)
    query = torch.cat([b["query"], torch.randn(pad, HEADS, HEAD)]).to(DEVICE)
    # As vLLM's Attention layer hands them: [tokens, heads, head] views.
    output = torch.full((n + pad, HEADS, HEAD), float("nan"), device=DEVICE)
    return impl, metadata, layer, query, b["kv"].to(DEVICE), output


def _tree_kernel_only(triton_attn: Any, triton_call: Any, monkeypatch: Any) -> list[dict]:
    """vLLM's ``unified_attention`` made to fail if reached; on CPU the tree kernel runs in
    the interpreter child and writes into the layer's own rows. Returns the list of the
    kernel's calls (CPU only; on a GPU the kernel runs in-process and nothing is recorded)."""

    def not_vllms(**_):
        raise AssertionError("a tree step reached vLLM's unified_attention")

    monkeypatch.setattr(triton_attn, "unified_attention", not_vllms)
    calls: list[dict] = []
    if DEVICE == "cpu":
        from vllm_specx.backends import cuda

        def remote(**kw):
            calls.append(kw)
            kw["out"].copy_(triton_call("triton_tree_attention:tree_attention", **kw))
            return kw["out"]

        monkeypatch.setattr(cuda, "tree_attention", remote)
    return calls


def test_patched_forward_with_tree_masks_gives_the_tree_attention(
        triton_attn, triton_call, monkeypatch) -> None:
    # Trees of 16 and 3 nodes, decodes, a 30-row chunked prefill and a 4-row chain.
    b = make_batch(2029, 16, HEADS, KV_HEADS, HEAD, "HND", max_nodes=16)
    n, pad = b["query"].shape[0], 3
    impl, metadata, layer, query, kv, output = _layer_inputs(triton_attn, b, pad)

    calls = _tree_kernel_only(triton_attn, triton_call, monkeypatch)
    masks = QueryMasks.causal_except(b["q_lens"], b["trees"])
    with query_masks(masks):
        got = impl.forward(layer, query, query, query, kv, metadata, output=output)
    assert got is output
    assert calls or DEVICE == "cuda"
    torch.testing.assert_close(output[:n].view(n, HEADS, HEAD).double().cpu(),
                               slow_reference(b), atol=2e-5, rtol=2e-5)
    assert bool(output[n:].isnan().all())  # padding rows: not attended, not written
    # The masks matter: the causal attention of the same rows differs.
    causal = dict(b, spec=[(c, len(p) + 1 if isinstance(p, list) else p) for c, p in b["spec"]])
    assert not torch.allclose(slow_reference(causal), slow_reference(b), atol=1e-3)


def test_the_route_under_model_runner_v2s_metadata(triton_attn, triton_call,
                                                   monkeypatch) -> None:
    """Model Runner V2 builds the layers' metadata through its own ``build_attn_metadata``
    (``v1/worker/gpu/attn_utils.py``: V2's CommonAttentionMetadata into the real
    ``TritonAttentionMetadataBuilder`` of a real ``AttentionGroup``), which its tree step
    (``glue/v2_tree_step.py``) leaves as V2 built it. With the step's tree masks set, the
    patched forward given that metadata writes the path-as-chain tree attention, as
    under V1's."""
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
    from vllm.v1.worker.utils import AttentionGroup

    b = make_batch(2031, 16, HEADS, KV_HEADS, HEAD, "NHD", max_nodes=16)
    n = b["query"].shape[0]
    impl, _, layer, query, kv, output = _layer_inputs(triton_attn, b, 2)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=KV_HEADS, head_size=HEAD,
                             dtype=torch.float32)
    group = AttentionGroup(backend=triton_attn.TritonAttentionBackend, layer_names=["l0"],
                           kv_cache_spec=spec, kv_cache_group_id=0)
    # Eager, as a tree config runs (no CUDA-graph capture sizes for the builder to read).
    config = VllmConfig(model_config=_engine_args(enforce_eager=True).create_model_config())
    group.create_metadata_builders(config, torch.device(DEVICE))
    kv_config = KVCacheConfig(num_blocks=kv.shape[0], kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    metadata = build_attn_metadata(
        attn_groups=[[group]], num_reqs=len(b["q_lens"]), num_tokens=n,
        query_start_loc_gpu=b["qsl"].to(DEVICE), query_start_loc_cpu=b["qsl"],
        max_query_len=max(b["q_lens"]), seq_lens=b["seq_lens"].to(DEVICE),
        max_seq_len=int(b["seq_lens"].max()), block_tables=[b["table"].to(DEVICE)],
        slot_mappings=torch.zeros(1, n, dtype=torch.int64, device=DEVICE),
        kv_cache_config=kv_config, seq_lens_cpu_upper_bound=b["seq_lens"])["l0"]
    assert type(metadata) is triton_attn.TritonAttentionMetadata
    assert metadata.num_actual_tokens == n and metadata.causal is True

    calls = _tree_kernel_only(triton_attn, triton_call, monkeypatch)
    with query_masks(QueryMasks.causal_except(b["q_lens"], b["trees"])):
        got = impl.forward(layer, query, query, query, kv, metadata, output=output)
    assert got is output
    assert calls or DEVICE == "cuda"
    torch.testing.assert_close(output[:n].view(n, HEADS, HEAD).double().cpu(),
                               slow_reference(b), atol=2e-5, rtol=2e-5)
    assert bool(output[n:].isnan().all())


def test_masks_of_another_forward_are_refused(triton_attn) -> None:
    """Masks built for other query lengths never reach a layer (as in the CPU op)."""
    b = make_batch(7, 16, HEADS, KV_HEADS, HEAD, "HND", max_nodes=12)
    impl, metadata, layer, query, kv, output = _layer_inputs(triton_attn, b, 0)
    other = QueryMasks.causal_except([q + 1 for q in b["q_lens"]], {})
    with query_masks(other), pytest.raises(RuntimeError, match="tree masks were built for"):
        impl.forward(layer, query, query, query, kv, metadata, output=output)


def test_patched_forward_without_masks_is_vllms_own(triton_attn, monkeypatch) -> None:
    b = make_batch(7, 16, HEADS, KV_HEADS, HEAD, "HND", max_nodes=12)
    impl, metadata, layer, query, kv, _ = _layer_inputs(triton_attn, b, 2)
    patched = triton_attn.TritonAttentionImpl.forward
    original = patched.__specx_original__
    if DEVICE == "cuda":
        outs = []
        for forward in (original, patched):
            out = torch.zeros(query.shape[0], HEADS, HEAD, device=DEVICE)
            outs.append(forward(impl, layer, query, query, query, kv, metadata, output=out))
        assert torch.equal(outs[0], outs[1])
        return
    seen = []
    monkeypatch.setattr(triton_attn, "unified_attention", lambda **kw: seen.append(kw))
    out = torch.zeros(query.shape[0], HEADS, HEAD)
    for forward in (original, patched):
        assert forward(impl, layer, query, query, query, kv, metadata, output=out) is out
    assert len(seen) == 2 and seen[0].keys() == seen[1].keys()
    for key, value in seen[0].items():
        other = seen[1][key]
        if isinstance(value, torch.Tensor):  # the same storage and view, not a copy
            assert (value.data_ptr(), value.shape, value.stride()) == (
                other.data_ptr(), other.shape, other.stride()), key
        else:
            assert value == other or value is other, key


def _engine_args(**kw):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_specx.fixtures import fixtures_root

    # A local model directory: with HF_HUB_OFFLINE=1 (the GPU machine) vLLM resolves any
    # other name through the hub cache and fails.
    return EngineArgs(model=str(fixtures_root() / "target"), **kw)


class _ModelConfig(SimpleNamespace):
    def get_sliding_window(self):
        return self.window


def _model_config(window=None, **hf):
    return _ModelConfig(window=window, hf_text_config=SimpleNamespace(**hf), enforce_eager=False)


@pytest.mark.parametrize("backend", [None, "TRITON_ATTN", "auto"])
def test_a_tree_config_on_cuda_gets_triton_attn_and_eager(backend) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    args = _engine_args(attention_backend=backend)
    model = _model_config()
    line = prepare_cuda_tree_engine(args, model, "adaptive", {"max_nodes": 8},
                                    runner="Model Runner V2 (why)")
    assert args.attention_backend in (AttentionBackendEnum.TRITON_ATTN, "TRITON_ATTN")
    assert args.enforce_eager and model.enforce_eager
    assert "\n" not in line and "TRITON_ATTN" in line and "eager" in line
    assert "CUDA graph" in line and line.endswith("; on Model Runner V2 (why).")
    assert ("switched" in line) == (backend in (None, "auto"))


@pytest.mark.parametrize("kw, fragment", [
    ({"attention_backend": "FLASH_ATTN"}, "FLASH_ATTN attention backend"),
    ({"attention_config": {"backend": "FLASHINFER"}}, "FLASHINFER attention backend"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
])
def test_a_tree_config_on_cuda_is_refused_in_one_line(kw, fragment) -> None:
    args = _engine_args(**kw)
    with pytest.raises(SpecxConfigError) as info:
        prepare_cuda_tree_engine(args, _model_config(), "specx_eagle3", True,
                                 runner="Model Runner V2 (why)")
    message = str(info.value)
    assert "\n" not in message and fragment in message, message
    assert message.startswith('speculative_config["draft_tree"] = True is not allowed for '
                              "method 'specx_eagle3' on CUDA")
    assert not args.enforce_eager  # nothing was changed


def test_model_features_the_tree_kernel_lacks_are_named() -> None:
    assert tree_config_refusal(_model_config(), "auto") is None
    assert "sliding window (4096)" in tree_config_refusal(_model_config(window=4096), None)
    assert "soft-capping" in tree_config_refusal(
        _model_config(attn_logit_softcapping=50.0), "auto")
