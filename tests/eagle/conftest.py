"""The test EAGLE-3 head for the fixture target, built by ``scripts/build_eagle3_fixture.py``
into a temporary directory (seeded random weights; well under a second)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_eagle3_fixture.py"


def head_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_eagle3_fixture", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def build_head(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``build_head(name, **config_overrides)``: a head directory for the fixture target."""
    builder = head_builder()

    def build(name: str = "eagle3_head", **overrides: Any) -> str:
        return str(builder.build(tmp_path_factory.mktemp(name), **overrides))

    return build


@pytest.fixture(scope="session")
def eagle3_head(build_head: Any) -> str:
    return build_head()


@pytest.fixture(scope="session")
def target() -> str:
    from vllm_specx.fixtures import fixtures_root

    return str(fixtures_root() / "target")
