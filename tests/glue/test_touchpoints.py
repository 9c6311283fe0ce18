"""The touch-point manifest against the installed vLLM and against our own source.

A vLLM upgrade that moves a patch target or a private name fails here with
"vLLM X no longer has Y, used by Z", instead of deep inside an engine start.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from vllm_specx.cpu_ops.drift import installed_vllm_version, release_key
from vllm_specx.glue import touchpoints
from vllm_specx.glue.patch_base import VERIFIED_RELEASES, VllmPatch

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_specx"
VLLM = release_key(installed_vllm_version())


def test_installed_vllm_has_every_patch_target():
    assert touchpoints.missing_patch_targets(VLLM) == []


def test_installed_vllm_has_every_private_name():
    assert touchpoints.missing_private_names(VLLM) == []


def test_every_patch_was_verified_on_the_installed_release():
    # ascend patches name the vLLM-Ascend source they were read against (tests/ascend).
    unverified = [f"{p.name} (verified on {', '.join(p.verified_on) or 'nothing'})"
                  for p in touchpoints.patches()
                  if VLLM not in p.verified_on and p.scope != touchpoints.ASCEND]
    assert unverified == [], (
        f"vLLM {VLLM}: do the upgrade checklist in vllm_specx/glue/touchpoints.py for "
        f"{unverified}"
    )


def test_patches_have_unique_names_known_scopes_and_reasons():
    points = touchpoints.patches()
    names = [p.name for p in points]
    assert len(names) == len(set(names))
    for p in points:
        assert p.scope in touchpoints.SCOPES, p
        assert p.target and p.replaces and p.why and p.verified_on, p
        module, _, attr = p.defined_in.partition(":")
        assert touchpoints.resolve(f"{module}:{attr}") is not None


def test_every_vllm_patch_object_in_the_package_is_in_the_manifest():
    """A VllmPatch subclass defined anywhere must be reachable from a registry the
    manifest reads, so a new patch cannot be applied without being listed."""
    listed = {type(p) for _, objs in touchpoints._vllm_patch_registries() for p in objs}
    defined = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                getattr(b, "id", None) == "VllmPatch" for b in node.bases
            ):
                defined.add(getattr(touchpoints.resolve(module), node.name))
    assert defined and all(issubclass(cls, VllmPatch) for cls in defined)
    assert defined <= listed, sorted(c.__name__ for c in defined - listed)


def _documented_patch_names(text: str) -> set[str]:
    return set(re.findall(r"^\* (\w+) -- ", text, flags=re.MULTILINE))


def test_manifest_docstring_lists_every_patch():
    names = {p.name for p in touchpoints.patches()}
    assert _documented_patch_names(touchpoints.__doc__ or "") == names


def test_docs_patch_table_lists_every_patch():
    # The patch manifest page of the docs site (moved from the README, issue 35).
    page = (ROOT / "docs" / "contributing" / "patches.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(\w+)` \|", page, flags=re.MULTILINE))
    names = {p.name for p in touchpoints.patches()}
    assert names <= rows, sorted(names - rows)


def _foreign_private_names() -> dict[str, list[str]]:
    """Underscore names the package uses but never defines itself: vLLM's (or torch's).

    Attribute reads/writes, getattr/hasattr/setattr/delattr with a constant name, and
    keyword arguments (dataclass ``replace(_field=...)``) are collected."""
    defined: set[str] = set()
    used: dict[str, list[str]] = {}

    def use(name: str, where: str) -> None:
        if name.startswith("_") and not name.startswith("__"):
            used.setdefault(name, []).append(where)

    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.alias):
                defined.add(node.asname or node.name.split(".")[-1])
            if isinstance(node, ast.Attribute):
                if isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                        and node.value.id == "self":
                    defined.add(node.attr)  # our own instance attribute
                else:
                    use(node.attr, f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in (
                    "getattr", "hasattr", "setattr", "delattr"
                ) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                        and isinstance(node.args[1].value, str):
                    use(node.args[1].value, f"{rel}:{node.lineno}")
                for kw in node.keywords:
                    if kw.arg is not None:
                        use(kw.arg, f"{rel}:{node.lineno}")
    return {name: where for name, where in used.items() if name not in defined}


# Private names of torch's that are not vLLM's and need no manifest entry (torch.ops._C
# is the namespace vLLM's ops live in; the drift checks cover it).
NOT_VLLM = {"_C"}


def test_every_foreign_private_name_in_the_package_is_in_the_manifest():
    listed = {n.name for n in touchpoints.PRIVATE_NAMES}
    unlisted = {name: where for name, where in _foreign_private_names().items()
                if name not in listed and name not in NOT_VLLM}
    assert unlisted == {}, (
        "add these vLLM private names to PRIVATE_NAMES in vllm_specx/glue/touchpoints.py: "
        f"{unlisted}"
    )


def test_private_name_entries_point_at_files_that_use_them():
    """A stale entry (the code stopped using the name) would hide the real list."""
    for entry in touchpoints.PRIVATE_NAMES:
        users = [f for f in entry.used_by if (ROOT / f).is_file()]
        assert users, f"{entry.name}: none of {entry.used_by} exists"
        assert any(entry.name in (ROOT / f).read_text(encoding="utf-8") for f in users), (
            f"{entry.name} is listed as used by {entry.used_by}, which do not mention it"
        )


def test_a_missing_name_is_reported_in_one_line_naming_it_and_its_user():
    fake = touchpoints.PrivateName(
        "vllm.v1.sample.rejection_sampler:RejectionSampler", "_gone_in_this_release",
        "attribute", ("vllm_specx/glue/sampler.py",), "logprobs")
    message = fake.missing("9.9.9")
    assert message is not None and "\n" not in message
    assert message.startswith("vLLM 9.9.9 no longer has ")
    assert "RejectionSampler._gone_in_this_release" in message
    assert "used by vllm_specx/glue/sampler.py" in message


@pytest.mark.parametrize("kind", ["field", "instance attribute", "source"])
def test_each_check_kind_detects_absence(kind):
    owner = {"field": "vllm.v1.attention.backend:CommonAttentionMetadata",
             "instance attribute": "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
             "source": "vllm.triton_utils.dispatcher"}[kind]
    absent = touchpoints.PrivateName(owner, "_no_such_name_anywhere", kind, ("x",), "test")
    assert absent.missing(VLLM) is not None


def test_verified_releases_are_in_the_cpu_drift_table():
    from vllm_specx.cpu_ops.schemas import supported_releases

    assert set(VERIFIED_RELEASES) <= set(supported_releases())
