"""Locate the small trained target/draft pair that tests and benchmarks use.

The pair is built by ``scripts/build_fixture_models.py`` (a tiny Llama target and a smaller
Llama draft self-distilled from it, both trained on the Python standard library's source) and
committed under ``fixtures/models/`` at the repository root. Those files are not package data:
a wheel does not carry them. So the lookup tries, in order, the directory named by the
``VLLM_SPECX_FIXTURES`` environment variable, the checkout that holds this file (editable
installs), and the current directory and its parents (a wheel used from inside a checkout).

Importing this module is cheap: it needs neither torch nor transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import warnings
from pathlib import Path
from typing import Any

ENV_VAR = "VLLM_SPECX_FIXTURES"
_REL = Path("fixtures") / "models"
_BUILD_HINT = (
    "run `python scripts/build_fixture_models.py` from the vllm-specx checkout "
    f"(12-25 minutes on 2 CPU cores), or point {ENV_VAR} at a directory holding "
    "target/, draft/ and heldout_prompts.jsonl"
)


def _is_fixture_root(path: Path) -> bool:
    return all(
        (path / sub / name).is_file()
        for sub in ("target", "draft")
        for name in ("config.json", "model.safetensors")
    )


def _candidates() -> list[Path]:
    env = os.environ.get(ENV_VAR)
    if env:
        # An explicit setting is the only candidate: silently falling back to another copy
        # would hide a typo.
        return [Path(env).expanduser()]
    here = Path(__file__).resolve()
    found = [here.parents[1] / _REL]
    cwd = Path.cwd().resolve()
    found += [d / _REL for d in (cwd, *cwd.parents)]
    return found


def fixtures_root() -> Path:
    """The directory holding ``target/``, ``draft/``, ``REPORT.json`` and the prompts."""
    tried = _candidates()
    for path in tried:
        if _is_fixture_root(path):
            return path
    looked = ", ".join(str(p) for p in dict.fromkeys(tried))
    raise FileNotFoundError(
        f"vllm-specx fixture models not found (looked in: {looked}); {_BUILD_HINT}"
    )


def fixture_model_dirs() -> tuple[Path, Path]:
    """Return ``(target_dir, draft_dir)``: Hugging Face model directories with tokenizer."""
    root = fixtures_root()
    return root / "target", root / "draft"


def heldout_prompts(n: int) -> list[str]:
    """The first ``n`` stored held-out prompts (code snippets the models never trained on).

    They come from ``heldout_prompts.jsonl``, written by the build script, so they do not
    depend on the Python version in use.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    records = heldout_records()
    path = fixtures_root() / "heldout_prompts.jsonl"
    with open(path, encoding="utf-8") as f:
        stored = sum(1 for line in f if line.strip())
    if n > stored:
        raise ValueError(f"only {stored} held-out prompts are stored, asked for {n}")
    # Fewer than n only where this Python's stdlib lacks some snippets' files (warned).
    return [r["prompt"] for r in records[:n]]


def heldout_records() -> list[dict[str, Any]]:
    """All held-out records: ``id``, ``source``, ``line``, ``prompt`` and ``text``
    (``text`` starts with ``prompt`` and continues the same file; used for perplexity).

    ``heldout_prompts.jsonl`` stores only where each snippet is in the Python standard
    library (file, first line, lengths) and a sha256 of its text: the text is read from
    this machine's stdlib, so none of it is copied into the repository. A snippet whose
    hash differs (another Python version) is still used, with a warning: the benchmark
    report's prompt hash then tells the runs apart. A snippet whose file this Python's
    stdlib no longer has (``distutils`` is gone from Python 3.12) is left out, with a
    warning.
    """
    path = fixtures_root() / "heldout_prompts.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {_BUILD_HINT}")
    with open(path, encoding="utf-8") as f:
        refs = [json.loads(line) for line in f if line.strip()]
    records = [materialise_heldout(ref) for ref in refs]
    return [r for r in records if r is not None]


def materialise_heldout(ref: dict[str, Any]) -> dict[str, Any] | None:
    """A stored held-out reference with its ``prompt`` and ``text`` read from the stdlib;
    None (with a warning) where this Python's stdlib lacks the file."""
    if "text" in ref:  # a record that carries its text
        return ref
    kind, _, rel = ref["source"].partition(":")
    if kind != "stdlib":
        raise ValueError(f"unknown held-out source {ref['source']!r}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not (stdlib / rel).is_file():
        warnings.warn(f"held-out snippet {ref['id']} ({rel}) is not in this Python's "
                      f"standard library; left out", stacklevel=3)
        return None
    lines = (stdlib / rel).read_text(encoding="utf-8").splitlines(keepends=True)
    text = "".join(lines[ref["line"] - 1:])[: ref["text_chars"]]
    if hashlib.sha256(text.encode("utf-8")).hexdigest() != ref["sha256"]:
        warnings.warn(
            f"held-out snippet {ref['id']} ({rel}:{ref['line']}) differs from the one the "
            f"fixtures were built with (another Python version?); using this machine's text",
            stacklevel=3,
        )
    return {**ref, "prompt": text[: ref["prompt_chars"]], "text": text}


def fixture_report() -> dict[str, Any]:
    """The build's ``REPORT.json`` (perplexities, agreement statistics, sizes, versions)."""
    path = fixtures_root() / "REPORT.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {_BUILD_HINT}")
    return json.loads(path.read_text(encoding="utf-8"))
