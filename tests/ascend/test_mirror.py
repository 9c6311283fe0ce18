"""The fake vLLM-Ascend and the Ascend patches cannot drift apart silently.

Every patch target and every vllm_ascend symbol the package imports must exist in the
fake (mirrored from the vLLM-Ascend commit the patches were read against); a target
missing from vLLM-Ascend fails at application with one line naming vLLM-Ascend.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from vllm_specx.glue import ascend
from vllm_specx.glue.patch_base import PatchTargetMissing

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_specx"


def _vllm_ascend_imports() -> set[tuple[str, str]]:
    """(module, name) of every ``from vllm_ascend... import name`` in the package."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_ascend"):
                found.update((node.module, alias.name) for alias in node.names)
    return found


def test_every_patch_target_exists_in_the_fake(ascend_unpatched) -> None:
    for patch in ascend.ASCEND_PATCHES:
        module = importlib.import_module(patch.module_name)
        owner, attr = patch._owner_and_attr(module)
        assert attr in vars(owner), f"{patch.name}: {patch.target} missing from the fake"


def test_every_vllm_ascend_import_of_the_package_exists_in_the_fake(ascend_unpatched) -> None:
    imports = _vllm_ascend_imports()
    assert ("vllm_ascend.sample.rejection_sampler", "AscendRejectionSampler") in imports
    for module_name, name in sorted(imports):
        module = importlib.import_module(module_name)
        assert hasattr(module, name), f"{module_name}.{name} missing from the fake"


def test_patches_name_the_mirrored_vllm_ascend_source() -> None:
    assert ascend.ASCEND_MIRROR_COMMIT.startswith("182b75ea84")
    for patch in ascend.ASCEND_PATCHES:
        assert patch.scope == ascend.ASCEND and patch.lazy
        assert patch.verified_on == (ascend.ASCEND_MIRROR,)
        assert patch.replaces and patch.why


def test_a_target_missing_from_vllm_ascend_fails_in_one_line(ascend_unpatched) -> None:
    runner_module = ascend_unpatched["vllm_ascend.worker.model_runner_v1"]
    original = runner_module.NPUModelRunner.__dict__["_get_drafter"]
    delattr(runner_module.NPUModelRunner, "_get_drafter")
    try:
        with pytest.raises(PatchTargetMissing) as info:
            ascend.AscendProposerDispatch().apply()
    finally:
        runner_module.NPUModelRunner._get_drafter = original
    message = str(info.value)
    assert "\n" not in message
    assert "ascend_proposer_dispatch" in message and "NPUModelRunner._get_drafter" in message
    assert "vLLM-Ascend" in message and "182b75ea84" in message


def test_patches_apply_once_and_revert(ascend_unpatched) -> None:
    runner_cls = ascend_unpatched["vllm_ascend.worker.model_runner_v1"].NPUModelRunner
    original = runner_cls.__dict__["_set_up_drafter"]
    patch = ascend.AscendSpecxSampler()
    patch.apply()
    patched = runner_cls.__dict__["_set_up_drafter"]
    patch.apply()  # vLLM loads plugins several times per process
    assert runner_cls.__dict__["_set_up_drafter"] is patched is not original
    patch.revert()
    assert runner_cls.__dict__["_set_up_drafter"] is original


def test_nothing_imports_vllm_ascend_or_torch_npu_without_the_platform() -> None:
    import vllm_specx.glue.ascend  # noqa: F401
    import vllm_specx.plugin  # noqa: F401

    assert not ascend.ascend_installed()
    ascend.apply_if_ascend()  # vLLM-Ascend not installed: registers nothing
    assert not [m for m in sys.modules if m.split(".")[0] in ("vllm_ascend", "torch_npu")]


def test_fakes_do_not_outlive_a_test() -> None:
    """Runs after the fixtures above in this module: nothing of the fakes is left."""
    assert not [m for m in sys.modules if m.split(".")[0] in ("vllm_ascend", "torch_npu")]
    assert not any(p.endswith("ascend/fakes") for p in sys.path)
