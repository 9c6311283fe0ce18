"""The benchmark's prompt set: the fixtures' held-out prompts, or a JSONL file."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PromptSet:
    prompts: list[str]
    source: str

    def describe(self) -> dict[str, Any]:
        """Provenance recorded in the report: source, count and a content hash."""
        return {
            "source": self.source,
            "count": len(self.prompts),
            "sha256": prompts_sha256(self.prompts),
            "mean_chars": (
                sum(len(p) for p in self.prompts) / len(self.prompts) if self.prompts else 0
            ),
        }


def prompts_sha256(prompts: list[str]) -> str:
    """Hash of the exact prompt list (order matters: request i gets seed + i)."""
    blob = json.dumps(prompts, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def read_jsonl(path: str | Path, limit: int | None = None) -> PromptSet:
    """Prompts from a JSONL prompt file (the format ``vllm-specx train-head`` reads too: a
    JSON string, an object with a ``"prompt"`` string, or a stdlib reference per non-empty
    line; see :func:`vllm_specx.training.data.read_prompt_file`). ``limit`` keeps the first
    ones."""
    from vllm_specx.training.data import read_prompt_file

    prompts = read_prompt_file(path)
    return PromptSet(prompts[:limit] if limit is not None else prompts, f"file:{Path(path)}")


def default_prompts(n: int) -> PromptSet:
    """The first ``n`` held-out prompts of the fixture pair (text the models never saw)."""
    from vllm_specx.fixtures import fixtures_root, heldout_prompts

    return PromptSet(heldout_prompts(n), f"fixtures:{fixtures_root() / 'heldout_prompts.jsonl'}")
