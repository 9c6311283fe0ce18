"""`specx_mtp` at engine-config time (no engine started): what it becomes, what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_specx.config import SPECX_CONFIG_KEY, SpecxConfigError

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 2, "num_hidden_layers": 1,
    "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 256,
    "torch_dtype": "float32",
}


def engine_config(model: str, speculative_config: dict):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, skip_tokenizer_init=True,
                      speculative_config=speculative_config).create_engine_config()


@pytest.fixture(scope="module")
def mtp_target() -> str:
    from vllm_specx.fixtures import fixtures_root

    return str(fixtures_root() / "mtp_target")


@pytest.mark.parametrize("spec", [
    {"method": "specx_mtp", "num_speculative_tokens": 3, "adaptive": True},
    {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True},  # vLLM's name + a knob
])
def test_specx_mtp_runs_vllm_mtp_with_specx_settings(mtp_target, spec):
    cfg = engine_config(mtp_target, spec)
    assert cfg.speculative_config.method == "mtp"
    assert cfg.speculative_config.num_speculative_tokens == 3
    settings = cfg.additional_config[SPECX_CONFIG_KEY]
    assert settings["method"] == "specx_mtp" and settings["adaptive"] is True
    assert cfg.scheduler_config.async_scheduling is False  # ragged drafts


def test_plain_vllm_mtp_stays_vllm(mtp_target):
    cfg = engine_config(mtp_target, {"method": "mtp", "num_speculative_tokens": 2})
    assert cfg.speculative_config.method == "mtp"
    assert SPECX_CONFIG_KEY not in (cfg.additional_config or {})


def test_target_without_mtp_layers_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    with pytest.raises(SpecxConfigError) as info:
        engine_config(str(tmp_path), {"method": "specx_mtp", "num_speculative_tokens": 2})
    message = str(info.value)
    assert "\n" not in message
    assert 'speculative_config["method"] = "specx_mtp"' in message  # key and value
    assert "model_type 'llama'" in message
    assert "num_nextn_predict_layers >= 1" in message  # what is needed


def _head(directory, hidden: int) -> str:
    import torch

    from vllm_specx.algorithms.acceptance_head import AcceptanceHead, save_head

    torch.manual_seed(0)
    return str(save_head(AcceptanceHead(hidden, num_blocks=1), directory))


def test_acceptance_head_must_fit_the_mtp_hidden_state(mtp_target, tmp_path):
    hidden = json.loads((Path(mtp_target) / "config.json").read_text())[
        "hidden_size"]
    fits = _head(tmp_path / "fits", hidden)
    cfg = engine_config(mtp_target, {"method": "specx_mtp", "num_speculative_tokens": 3,
                                     "adaptive": True, "acceptance_head": fits})
    assert cfg.additional_config[SPECX_CONFIG_KEY]["acceptance_head"] == fits

    wrong = _head(tmp_path / "wrong", hidden + 8)
    with pytest.raises(SpecxConfigError) as info:
        engine_config(mtp_target, {"method": "specx_mtp", "num_speculative_tokens": 3,
                                   "adaptive": True, "acceptance_head": wrong})
    message = str(info.value)
    assert "\n" not in message
    assert 'speculative_config["acceptance_head"]' in message and wrong in message
    assert f"a head for hidden size {hidden} (the MTP layer's)" in message
    assert f"expects hidden size {hidden + 8}" in message
