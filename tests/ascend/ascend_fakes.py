"""Load the fake torch_npu / vllm_ascend (tests/ascend/fakes) for one test, then remove
every trace (sys.modules, sys.path, the patches, the cached sampler class), since the
whole suite runs in one process and no other test may see a vllm_ascend."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

FAKES = Path(__file__).resolve().parent / "fakes"
FAKE_ROOTS = ("torch_npu", "vllm_ascend")


def _is_fake(name: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in FAKE_ROOTS)


@contextmanager
def fake_vllm_ascend(apply_patches: bool = True) -> Iterator[dict[str, ModuleType]]:
    """The fake modules by name; the specx Ascend patches applied to them."""
    from vllm_specx.glue import ascend

    leftover = [name for name in sys.modules if _is_fake(name)]
    assert not leftover, f"a vllm_ascend/torch_npu is already loaded: {leftover}"
    sys.path.insert(0, str(FAKES))
    importlib.invalidate_caches()
    try:
        names = ("vllm_ascend", "vllm_ascend.platform", "vllm_ascend.utils",
                 "vllm_ascend.ascend_config", "vllm_ascend.spec_decode",
                 "vllm_ascend.spec_decode.eagle_proposer",
                 "vllm_ascend.spec_decode.llm_base_proposer",
                 "vllm_ascend.sample.rejection_sampler", "vllm_ascend.worker.model_runner_v1")
        modules = {name: importlib.import_module(name) for name in names}
        if apply_patches:
            for patch in ascend.ASCEND_PATCHES:
                patch.apply()
        yield modules
    finally:
        for patch in ascend.ASCEND_PATCHES:
            patch.revert()
        ascend._sampler_class = None  # built on the fake base class
        sys.path.remove(str(FAKES))
        for name in [n for n in sys.modules if _is_fake(n)]:
            del sys.modules[name]
        importlib.invalidate_caches()
