"""`eagle3` / `eagle` + the adaptive knobs at engine-config time (no engine started): read
as the specx methods over vLLM's EAGLE drafting; vLLM's own methods untouched; heads that
do not fit the target refused in one line."""

from __future__ import annotations

import pytest

from vllm_specx.config import SPECX_CONFIG_KEY, SpecxConfigError, translate
from vllm_specx.methods import METHODS


def engine_config(model: str, speculative_config: dict):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=256,
                      speculative_config=speculative_config).create_engine_config()


@pytest.mark.parametrize("method", ["eagle3", "specx_eagle3"])
def test_eagle3_with_adaptive_is_specx_eagle3(target, eagle3_head, method):
    cfg = engine_config(target, {"method": method, "model": eagle3_head,
                                 "num_speculative_tokens": 3, "adaptive": True})
    assert cfg.speculative_config.method == "eagle3"
    assert cfg.speculative_config.num_speculative_tokens == 3
    settings = cfg.additional_config[SPECX_CONFIG_KEY]
    assert settings["method"] == "specx_eagle3" and settings["adaptive"] is True
    assert settings["confidence_threshold"] == METHODS["specx_eagle3"].knob(
        "confidence_threshold").default
    assert cfg.scheduler_config.async_scheduling is False  # ragged drafts


def test_plain_vllm_eagle3_stays_vllm(target, eagle3_head):
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3}
    cfg = engine_config(target, dict(spec))
    assert cfg.speculative_config.method == "eagle3"
    assert SPECX_CONFIG_KEY not in (cfg.additional_config or {})


@pytest.mark.parametrize("base", ["eagle", "eagle3"])
def test_vllm_names_select_specx_only_with_a_specx_knob(base):
    from vllm_specx.backends import select_backend
    from vllm_specx.glue.patches import vllm_method_names, vllm_speculative_fields

    def tr(config: dict):
        return translate(config, vllm_methods=vllm_method_names(),
                         vllm_fields=vllm_speculative_fields(),
                         limits=select_backend().limits, device="cpu")

    assert tr({"method": base, "model": "head", "num_speculative_tokens": 2}) is None
    for knob in ("adaptive", "stop_threshold"):
        given = {"adaptive": True, knob: True if knob == "adaptive" else 0.5}
        result = tr({"method": base, "model": "head", **given})
        assert result.specx_settings["method"] == f"specx_{base}"
        assert result.vllm_speculative_config == {
            "method": base, "model": "head", "num_speculative_tokens": 8}
    with pytest.raises(SpecxConfigError, match='"stop_threshold".*only applies with "adaptive"'):
        tr({"method": base, "model": "head", "stop_threshold": 0.5})


@pytest.mark.parametrize("overrides, needle", [
    ({"target_hidden_size": 512},
     "the head's target_hidden_size 512 does not fit the target's hidden size 256"),
    ({"vocab_size": 8192},
     "the head's vocab_size 8192 does not fit the target's vocabulary of 4096 tokens"),
    ({"eagle_config": {"use_aux_hidden_state": True,
                       "eagle_aux_hidden_state_layer_ids": [1, 2, 7]}},
     "layers [1, 2, 7], but the target has layers 0..3"),
])
def test_a_head_that_does_not_fit_the_target_is_refused_in_one_line(
        target, build_head, overrides, needle):
    head = build_head("misfit", **overrides)
    with pytest.raises(SpecxConfigError) as info:
        engine_config(target, {"method": "eagle3", "model": head, "adaptive": True})
    message = str(info.value)
    assert "\n" not in message
    assert f'speculative_config["model"] = "{head}" is not allowed' in message
    assert "'specx_eagle3'" in message and needle in message


def test_acceptance_head_must_fit_the_eagle_head(target, eagle3_head, tmp_path):
    import torch

    from vllm_specx.algorithms.acceptance_head import AcceptanceHead, save_head

    torch.manual_seed(0)
    wrong = str(save_head(AcceptanceHead(264, num_blocks=1), tmp_path / "wrong"))
    with pytest.raises(SpecxConfigError) as info:
        engine_config(target, {"method": "eagle3", "model": eagle3_head, "adaptive": True,
                               "acceptance_head": wrong})
    message = str(info.value)
    assert "\n" not in message
    assert 'speculative_config["acceptance_head"]' in message and "264" in message


def _translate(config: dict, device: str = "cpu"):
    from vllm_specx.backends import backend_for_device
    from vllm_specx.glue.patches import vllm_method_names, vllm_speculative_fields

    return translate(config, vllm_methods=vllm_method_names(),
                     vllm_fields=vllm_speculative_fields(),
                     limits=backend_for_device(device).limits, device=device)


@pytest.mark.parametrize("base", ["eagle", "eagle3"])
def test_vllm_name_with_draft_tree_is_the_specx_head_tree(base):
    """The knob-only-specx rule: vLLM's eagle/eagle3 plus draft_tree is specx_eagle/3;
    vLLM's num_speculative_tokens becomes the tree's node budget (at least the head's fed
    nodes + 1, whose KV lives in the lookahead slots)."""
    dynamic = _translate({"method": base, "model": "head",
                          "draft_tree": {"max_nodes": 16, "max_depth": 5, "branching": 4}})
    assert dynamic.specx_settings["method"] == f"specx_{base}"
    assert dynamic.vllm_speculative_config == {
        "method": base, "model": "head", "num_speculative_tokens": 17}
    small = _translate({"method": base, "model": "head",
                        "draft_tree": {"max_nodes": 8, "max_depth": 4, "branching": 2}})
    assert small.vllm_speculative_config["num_speculative_tokens"] == 8
    static = _translate({"method": base, "model": "head",
                         "draft_tree": {"paths": [[0], [1], [0, 0], [0, 0, 0]]}})
    assert static.specx_settings["method"] == f"specx_{base}"
    assert static.vllm_speculative_config["num_speculative_tokens"] == 4
    assert _translate({"method": base, "model": "head"}) is None  # vLLM's own


@pytest.mark.parametrize("tree, message", [
    ({"max_nodes": 0}, r'draft_tree\["max_nodes"\] = 0 is not allowed: an integer from 1'),
    ({"max_nodes": 64, "max_depth": 16, "branching": 8}, r"= 120 frontier nodes fed to the head"),
    ({"paths": [[0], [0, 0, 1]]}, r"has the path \[0, 0, 1\] but not its prefix"),
    ({"branching": 2, "sampled_children": True}, r"unknown keys \['sampled_children'\]"),
    ("wide", r"'specx_eagle3': false, true, "),
])
def test_bad_head_tree_knobs_are_refused_in_one_line(tree, message):
    with pytest.raises(SpecxConfigError, match=message) as err:
        _translate({"method": "eagle3", "model": "head", "draft_tree": tree})
    assert "\n" not in str(err.value)
    assert str(err.value).startswith('speculative_config["draft_tree"]')


def test_head_tree_refused_with_adaptive_and_off_cpu():
    with pytest.raises(SpecxConfigError, match='not with "adaptive": true') as err:
        _translate({"method": "specx_eagle3", "model": "head", "adaptive": True,
                    "draft_tree": True})
    assert "\n" not in str(err.value)
    with pytest.raises(SpecxConfigError, match="not on npu yet") as err:
        _translate({"method": "eagle3", "model": "head", "draft_tree": True}, device="npu")
    assert "\n" not in str(err.value)
    # CUDA verifies head trees on the V1 runner (docs/trees.md "On CUDA and Ascend").
    assert _translate({"method": "eagle3", "model": "head", "draft_tree": True},
                      device="cuda").specx_settings["draft_tree"]
    # specx_mtp's tree knob: tests/mtp/test_mtp_config.py.


def test_head_tree_on_model_runner_v2_is_accepted(target, eagle3_head, monkeypatch):
    """A head tree runs on V2 too (glue/v2_eagle.py; tests/v2/test_v2_trees.py): forcing
    V2 with draft_tree is no longer refused, and the tree knob reaches the specx
    settings."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    try:
        cfg = engine_config(target, {"method": "eagle3", "model": eagle3_head,
                                     "draft_tree": {"paths": [[0], [1]]}})
    except ValueError as err:
        # Without Triton vLLM itself refuses a forced V2 ("Model Runner V2 requires
        # Triton"; tests/v2 runs V2 under the interpreter): not the specx tree refusal.
        assert "draft_tree" not in str(err) and "Triton" in str(err), err
        return
    settings = cfg.additional_config[SPECX_CONFIG_KEY]
    assert settings["method"] == "specx_eagle3"
    assert settings["draft_tree"] == {"paths": [[0], [1]]}
