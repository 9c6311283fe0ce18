"""mtad's ``draft_tree`` knob (issue 37): translated so vLLM schedules a whole tree, and
refused before start in one line for a bad value, a device or a runner it cannot run on."""

from __future__ import annotations

import pytest

from vllm_specx.backends import backend_for_device
from vllm_specx.config import SpecxConfigError, translate
from vllm_specx.glue.patches import vllm_method_names, vllm_speculative_fields
from vllm_specx.methods import METHODS, tree_max_nodes

BASE = {"method": "mtad", "model": "draft", "num_speculative_tokens": 3, "num_beams": 4}


def run(config: dict, device: str = "cpu"):
    return translate(config, vllm_methods=vllm_method_names(),
                     vllm_fields=vllm_speculative_fields(),
                     limits=backend_for_device(device).limits, device=device,
                     check_available=False)


@pytest.mark.parametrize("tree, nodes", [(True, 12), ({"max_nodes": 5}, 5),
                                         ({"max_nodes": 40}, 12), ({}, 12)])
def test_vllm_schedules_the_tree_the_drafter_keeps_its_depth(tree, nodes):
    result = run({**BASE, "draft_tree": tree})
    assert result.vllm_speculative_config["num_speculative_tokens"] == nodes
    assert result.specx_settings["num_speculative_tokens"] == 3  # the beams' depth
    assert result.specx_settings["draft_tree"] == tree
    assert tree_max_nodes(result.specx_settings) == nodes
    # The tree step runs on Model Runner V2 too (glue/v2_tree_step.py): vLLM may pick it.
    assert METHODS["mtad"].v1_only_reason(result.specx_settings) is None


def test_off_by_default_and_chain_k_unchanged():
    result = run(dict(BASE))
    assert result.specx_settings["draft_tree"] is False
    assert result.vllm_speculative_config["num_speculative_tokens"] == 3
    assert METHODS["mtad"].v1_only_reason(result.specx_settings) is None


@pytest.mark.parametrize("config, device, fragments", [
    ({"draft_tree": "yes"}, "cpu", ['"draft_tree"] = "yes"', 'false, true or {"max_nodes"']),
    ({"draft_tree": 1}, "cpu", ['"draft_tree"] = 1']),
    ({"draft_tree": {"max_depth": 3}}, "cpu", ["mtad's tree is its beams"]),
    ({"draft_tree": {"paths": [[0]]}}, "cpu", ["mtad's tree is its beams"]),
    ({"draft_tree": {"max_nodes": 0}}, "cpu", ['"max_nodes" must be an integer from 1 to 64']),
    ({"draft_tree": {"max_nodes": True}}, "cpu", ['"max_nodes" must be an integer']),
    ({"draft_tree": True, "num_beams": 8, "num_speculative_tokens": 9}, "cpu",
     ["72 tree nodes exceed 64"]),
    ({"draft_tree": {}, "num_beams": 8, "num_speculative_tokens": 9}, "cpu",
     ["72 tree nodes exceed 64"]),
    ({"draft_tree": {"max_nodes": 8}}, "npu", ["not on npu yet"]),
])
def test_bad_tree_configs_are_refused_in_one_line(config, device, fragments):
    with pytest.raises(SpecxConfigError) as info:
        run({**BASE, **config}, device=device)
    message = str(info.value)
    assert "\n" not in message and 'speculative_config["draft_tree"]' in message
    assert "for method 'mtad'" in message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("method", ["mtad", "adaptive"])
def test_trees_pass_validation_on_cuda(method):
    """CUDA verifies trees (V1 runner, TRITON_ATTN: tests/backends/test_cuda_tree_route.py);
    the engine-side switch and refusals run later, in the translation patch."""
    config = BASE if method == "mtad" else ADAPTIVE
    result = run({**config, "draft_tree": True}, device="cuda")
    assert result.specx_settings["draft_tree"]


def test_tree_knob_belongs_to_the_draft_model_methods():
    owners = "'mtad', 'adaptive', 'specx_mtp', 'specx_eagle' or 'specx_eagle3'"
    with pytest.raises(SpecxConfigError, match=f"belongs to specx method {owners}"):
        run({"method": "ngram", "num_speculative_tokens": 3, "draft_tree": True})


ADAPTIVE = {"method": "adaptive", "model": "draft", "num_speculative_tokens": 4}


@pytest.mark.parametrize("tree, nodes", [
    (True, 16), ({"max_nodes": 8, "max_depth": 3, "branching": 3}, 8),
    ({"max_nodes": 30, "max_depth": 2, "branching": 4}, 8),  # 4 x 2 beam positions at most
    # Defaults never exceed the max_nodes given (were refused: "max_depth = 5", unset).
    ({"max_nodes": 2}, 2), ({"max_nodes": 3, "branching": 1}, 3),
    # i.i.d. children for sampled requests (the default) or the top-k tree: same budget.
    ({"max_nodes": 8, "max_depth": 3, "branching": 3, "sampled_children": False}, 8),
    ({"sampled_children": True}, 16),
])
def test_adaptive_tree_is_scheduled_as_its_node_budget(tree, nodes):
    from vllm_specx.glue.mtad_proposer import tree_drafter_settings

    result = run({**ADAPTIVE, "draft_tree": tree})
    assert result.vllm_speculative_config["num_speculative_tokens"] == nodes
    drafter = tree_drafter_settings(result.specx_settings)
    given = tree if isinstance(tree, dict) else {}
    cap = given.get("max_nodes", 16)
    shape = {"max_nodes": 16, "max_depth": min(5, cap), "branching": min(4, cap), **given}
    assert (drafter["num_beams"], drafter["num_speculative_tokens"]) == (
        shape["branching"], shape["max_depth"])
    assert METHODS["adaptive"].v1_only_reason(result.specx_settings) is None  # V2 too


@pytest.mark.parametrize("tree, device, fragment", [
    ({"max_depth": 0}, "cpu", 'draft_tree["max_depth"] = 0 is not allowed'),
    ({"max_nodes": 8, "max_depth": 3, "branching": 9}, "cpu", "more children than max_nodes"),
    ({"depth": 3}, "cpu", "unknown keys ['depth']"),
    ({"sampled_children": "yes"}, "cpu", '"sampled_children" must be true or false'),
    ({"paths": [[0], [1]]}, "cpu", 'static "paths" trees are not drafted by a draft model'),
    ({"max_nodes": 64, "max_depth": 16, "branching": 32}, "cpu",
     '"branching" * "max_depth" = 512 exceeds 256 on cpu'),
    (True, "npu", "not on npu yet"),
])
def test_bad_adaptive_trees_are_refused_in_one_line(tree, device, fragment):
    with pytest.raises(SpecxConfigError) as info:
        run({**ADAPTIVE, "draft_tree": tree}, device=device)
    message = str(info.value)
    assert "\n" not in message and "for method 'adaptive'" in message
    assert fragment in message, message
