"""The MTP fixture's MLA head sizes are ones vLLM's CUDA MLA backends accept (no GPU needed).

Read from vLLM's own backend classes, not copied: a vLLM upgrade that drops these sizes from
the FLASH_ATTN prefill backend's list (the only MLA prefill backend vLLM 0.32 tries on
Hopper) or changes what the Hopper decode backends accept fails here, before a GPU run does.
The fixture used (qk_nope 32, qk_rope 64, v 32) first, which no CUDA prefill backend accepts
("FLASH_ATTN: Model does not have supported MLA dimensions", issue 36).
"""

from __future__ import annotations

import json

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
