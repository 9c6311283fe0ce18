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
    """Prompts from a JSONL file: each non-empty line is a JSON string or an object with a
    ``"prompt"`` string. ``limit`` keeps the first ones."""
    path = Path(path)
    prompts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc.msg}") from None
            if isinstance(item, dict):
                item = item.get("prompt")
            if not isinstance(item, str) or not item:
                raise ValueError(
                    f'{path}:{lineno}: expected a JSON string or an object with a "prompt" '
                    "string"
                )
            prompts.append(item)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return PromptSet(prompts, f"file:{path}")


def default_prompts(n: int) -> PromptSet:
    """The first ``n`` held-out prompts of the fixture pair (text the models never saw)."""
    from vllm_specx.fixtures import fixtures_root, heldout_prompts

    return PromptSet(heldout_prompts(n), f"fixtures:{fixtures_root() / 'heldout_prompts.jsonl'}")
