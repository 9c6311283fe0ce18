"""The MTP fixture's MLA head sizes are ones vLLM's CUDA MLA backends accept (no GPU needed).

Read from vLLM's own backend classes, not copied: a vLLM upgrade that drops these sizes from
the FLASH_ATTN prefill backend's list (the only MLA prefill backend vLLM 0.32 tries on
Hopper) or changes what the Hopper decode backends accept fails here, before a GPU run does.
The fixture used (qk_nope 32, qk_rope 64, v 32) first, which no CUDA prefill backend accepts
("FLASH_ATTN: Model does not have supported MLA dimensions", issue 36).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from vllm_specx.fixtures import fixtures_root

# vLLM's "auto" dtype on CUDA turns a float32 checkpoint into bfloat16 (config/model.py
# _resolve_auto_dtype), and the CUDA MLA kernels take only float16/bfloat16.
CUDA_DTYPE = torch.bfloat16
HOPPER = (9, 0)


@pytest.fixture
def cuda_names(monkeypatch):
    """vLLM's CUDA attention modules import names that ``fa_utils`` defines only on CUDA
    (``compile_flash_attn_varlen_func_from_specs``, ...); stand-ins (never called) let the
    backend classes import here, where only their class-level checks run."""
    from vllm.v1.attention.backends import fa_utils

    for name in ("compile_flash_attn_varlen_func_from_specs", "flash_attn_varlen_func",
                 "get_scheduler_metadata", "reshape_and_cache_flash"):
        if not hasattr(fa_utils, name):
            monkeypatch.setattr(fa_utils, name, None, raising=False)


@pytest.fixture(scope="module")
def mtp_config() -> dict:
    return json.loads((fixtures_root() / "mtp_target" / "config.json").read_text())


def mla_dimensions(config: dict):
    from vllm.v1.attention.backends.mla.prefill.base import MLADimensions

    return MLADimensions(
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
    )


def test_flash_attn_prefill_accepts_the_fixture_dimensions(mtp_config, cuda_names, monkeypatch):
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.mla.prefill.selector import MLAPrefillSelectorConfig

    backend = MLAPrefillBackendEnum.FLASH_ATTN.get_class()
    dims = mla_dimensions(mtp_config)
    assert backend.supports_mla_dimensions(dims), f"FLASH_ATTN prefill refuses {dims}"
    # The old sizes are refused by the same check (so the check can fail).
    old = type(dims)(qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32)
    assert not backend.supports_mla_dimensions(old)
    # The whole selector check on a Hopper, with the kernel taken as installed (it is not
    # on this CPU machine; that is the only reason it may give here).
    monkeypatch.setattr(backend, "is_available", classmethod(lambda cls: True))
    reasons = backend.validate_configuration(
        DeviceCapability(*HOPPER),
        MLAPrefillSelectorConfig(dtype=CUDA_DTYPE, mla_dimensions=dims),
    )
    assert reasons == []


@pytest.mark.parametrize("name", ["FLASH_ATTN_MLA", "FLASHMLA"])
def test_hopper_mla_decode_backends_accept_the_fixture(mtp_config, name, cuda_names,
                                                        monkeypatch):
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType, MultipleOf
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum[name].get_class()
    # supports_combination asks only whether the compiled kernel exists on this device
    # (flash_attn_supports_mla / is_flashmla_dense_supported): taken as yes, as on an H100.
    monkeypatch.setattr(backend, "supports_combination", classmethod(lambda cls, *a: None))
    block = backend.get_supported_kernel_block_sizes()[0]
    block_size = block.base if isinstance(block, MultipleOf) else block
    # Decode attends over the latent cache row: kv_lora_rank + qk_rope_head_dim wide.
    head_size = mtp_config["kv_lora_rank"] + mtp_config["qk_rope_head_dim"]
    reasons = backend.validate_configuration(
        head_size=head_size, dtype=CUDA_DTYPE, kv_cache_dtype="auto", block_size=block_size,
        use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(*HOPPER),
        attn_type=AttentionType.DECODER,
    )
    assert reasons == [], f"{name}: {reasons}"


def test_widening_the_heads_keeps_the_model_s_function(monkeypatch):
    """``build_mtp_fixture.py --stage widen`` (how the committed weights got these sizes):
    a random tiny DeepSeek-V3 widened from (nope 4, v 4) to (nope 8, v 16) gives the same
    logits, and the widened tensors have the new shapes."""
    import importlib.util
    from pathlib import Path

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    script = Path(__file__).resolve().parents[2] / "scripts" / "build_mtp_fixture.py"
    spec = importlib.util.spec_from_file_location("build_mtp_fixture", script)
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, builder)  # its dataclasses look it up
    spec.loader.exec_module(builder)

    def model(nope: int, v: int) -> DeepseekV3ForCausalLM:
        cfg = DeepseekV3Config(
            vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            first_k_dense_replace=3, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=nope, v_head_dim=v, head_dim=8, max_position_embeddings=64,
        )
        cfg._attn_implementation = "eager"
        return DeepseekV3ForCausalLM(cfg).float().eval()

    torch.manual_seed(0)
    narrow, wide = model(4, 4), model(8, 16)
    state = builder.widen_mla_heads(narrow.state_dict(), 2, 8, (4, 4), (8, 16))
    wide.load_state_dict(state)  # strict: every shape matches the wide model
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        before, after = narrow(input_ids=ids).logits, wide(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert before.std() > 0.01  # a model that computes something
    with pytest.raises(ValueError):
        builder.widen_mla_heads(narrow.state_dict(), 2, 8, (4, 4), (2, 16))
