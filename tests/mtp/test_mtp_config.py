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


def engine_config(model: str, speculative_config: dict, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, skip_tokenizer_init=True,
                      speculative_config=speculative_config, **kw).create_engine_config()


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


def test_a_fixed_k_keeps_async_scheduling_on_v2_only(mtp_target, monkeypatch):
    """At a fixed K, specx_mtp (as specx_eagle3) drafts on Model Runner V2 with vLLM's own
    speculator, K for every request, so V2 keeps vLLM's async scheduling; on V1 the specx
    chain drafter drafts, synchronously, and an explicit async request is refused in one
    line that says so. With the adaptive stop the drafts are ragged on either runner."""
    from vllm_specx.methods import drafts_ragged

    fixed = {"method": "specx_mtp", "num_speculative_tokens": 2}
    adaptive = {**fixed, "adaptive": True}
    assert not drafts_ragged(fixed, on_v2=True) and drafts_ragged(fixed, on_v2=False)
    assert drafts_ragged(adaptive, on_v2=True) and drafts_ragged(adaptive, on_v2=False)
    assert not drafts_ragged({**fixed, "method": "specx_eagle3"}, on_v2=True)
    assert drafts_ragged({**fixed, "draft_tree": True}, on_v2=True)
    assert drafts_ragged({"method": "adaptive", "num_speculative_tokens": 2}, on_v2=True)
    # This CPU process picks V1 (no Triton): synchronous, and async refused.
    assert engine_config(mtp_target, dict(fixed)).scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="on Model Runner V1: .*keeps async") as err:
        engine_config(mtp_target, dict(fixed), async_scheduling=True)
    assert "\n" not in str(err.value)
    # Forced onto V2: no specx refusal of async at a fixed K (what remains is vLLM's own,
    # no Triton here); the adaptive stop is still refused async.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="Model Runner V2 requires Triton") as err:
        engine_config(mtp_target, dict(fixed), async_scheduling=True)
    assert "async_scheduling" not in str(err.value)
    with pytest.raises(ValueError, match="async_scheduling = true is not allowed"):
        engine_config(mtp_target, dict(adaptive), async_scheduling=True)


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


# -- draft trees (issue 37): the MTP layer drafts the EAGLE heads' trees ------------------
def _translate(config: dict, device: str = "cpu"):
    from vllm_specx.backends import select_backend
    from vllm_specx.config import translate
    from vllm_specx.glue.patches import vllm_method_names, vllm_speculative_fields

    return translate(config, vllm_methods=vllm_method_names(),
                     vllm_fields=vllm_speculative_fields(),
                     limits=select_backend().limits, device=device)


@pytest.mark.parametrize("method", ["mtp", "specx_mtp"])
def test_mtp_with_draft_tree_is_specx_mtp_scheduled_as_its_node_budget(method):
    """vLLM's mtp + draft_tree is specx_mtp (the knob-only rule); with no K given (vLLM
    would read 1 from the MTP config) vLLM's num_speculative_tokens is the tree's budget."""
    dynamic = _translate({"method": method, "draft_tree": True})
    assert dynamic.specx_settings["method"] == "specx_mtp"
    assert dynamic.specx_settings["cost_control"] is True  # trees are pruned by default
    assert dynamic.vllm_speculative_config == {"method": "mtp", "num_speculative_tokens": 17}
    small = _translate({"method": method, "num_speculative_tokens": 2,
                        "draft_tree": {"max_nodes": 8, "max_depth": 4, "branching": 2}})
    assert small.vllm_speculative_config["num_speculative_tokens"] == 8
    static = _translate({"method": method, "draft_tree": {"paths": [[0], [1], [0, 0]]}})
    assert static.vllm_speculative_config["num_speculative_tokens"] == 3
    whole = _translate({"method": method, "draft_tree": True, "cost_control": False})
    assert whole.specx_settings["cost_control"] is False


@pytest.mark.parametrize("config, message", [
    ({"draft_tree": {"max_nodes": 0}}, r'draft_tree\["max_nodes"\] = 0 is not allowed'),
    ({"draft_tree": {"paths": [[0], [0, 0, 1]]}}, r"has the path \[0, 0, 1\] but not its"),
    ({"draft_tree": "wide"}, r"'specx_mtp': false, true, "),
    ({"draft_tree": True, "adaptive": True}, r'not with "adaptive": true'),
])
def test_bad_mtp_tree_knobs_are_refused_in_one_line(config, message):
    with pytest.raises(SpecxConfigError, match=message) as err:
        _translate({"method": "mtp", **config})
    assert "\n" not in str(err.value)
    assert str(err.value).startswith('speculative_config["draft_tree"]')


def test_mtp_tree_runs_on_model_runner_v2_and_an_mla_target_stays_refused(mtp_target,
                                                                           monkeypatch):
    from vllm_specx.methods import METHODS

    # specx_mtp's tree has a V2 speculator (glue/v2_eagle.py's MtpChainV2Speculator,
    # tested in tests/v2/test_v2_trees.py as plain attention): no setting keeps it on V1.
    # A forced V2 refuses an MLA target's tree in one line, as V1 does (this process has
    # no Triton, so the plain-attention config itself cannot be built on V2 here).
    assert METHODS["specx_mtp"].v1_only_reason({"draft_tree": {}}) is None
    assert METHODS["specx_mtp"].v1_only_reason({"draft_tree": {"paths": [[0]]}}) is None
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    with pytest.raises(SpecxConfigError, match="MLA") as err:
        engine_config(mtp_target, {"method": "mtp", "draft_tree": True})
    assert "\n" not in str(err.value) and "VLLM_MLA_DISABLE=1" in str(err.value)


def test_mtp_tree_needs_a_target_attention_that_takes_the_mask(mtp_target, monkeypatch):
    """The MTP fixture is DeepSeek-V3 with MLA: vLLM's CPU_MLA attention takes no tree
    mask, so the tree is refused before start in one line; as plain attention
    (VLLM_MLA_DISABLE=1, what tests/mtp/test_mtp_engine_plain_attention.py runs) it is
    configured with vLLM's K = the tree's node budget and synchronous scheduling."""
    tree = {"max_nodes": 8, "max_depth": 4, "branching": 2}
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    with pytest.raises(SpecxConfigError) as err:
        engine_config(mtp_target, {"method": "mtp", "draft_tree": tree})
    message = str(err.value)
    assert "\n" not in message and message.startswith('speculative_config["draft_tree"]')
    assert "MLA" in message and "VLLM_MLA_DISABLE=1" in message
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    cfg = engine_config(mtp_target, {"method": "mtp", "draft_tree": tree})
    assert cfg.model_config.use_mla is False
    assert cfg.speculative_config.method == "mtp"
    assert cfg.speculative_config.num_speculative_tokens == 8
    assert cfg.additional_config[SPECX_CONFIG_KEY]["draft_tree"] == tree
    assert cfg.scheduler_config.async_scheduling is False
