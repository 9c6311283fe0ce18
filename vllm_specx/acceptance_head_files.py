"""Whether an acceptance-head directory exists and fits a draft model, read from files.

No torch, no vLLM: config validation (``vllm_specx/config.py``), the method registry's
cross-knob check (``vllm_specx/methods.py``) and the engine-time check of ``specx_mtp``
(``glue/patches.py``) all ask :func:`acceptance_head_problem`.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path


def _looks_like_local_path(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or os.sep + os.sep in value or value.count("/") != 1


def read_safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors header (no torch needed)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def acceptance_head_problem(
    head: str,
    *,
    draft_model: str | None,
    hidden_size: int | None = None,
    whose: str = "the draft model's",
) -> str | None:
    """Why an acceptance head does not exist or does not fit the draft model (what is
    allowed instead), or None when it is acceptable.

    A local head is a directory with ``model.safetensors`` whose output layer maps the
    draft's hidden size to 2 classes (reject, accept). A hub id that is not a local
    directory is accepted here and resolved when the head is loaded.
    """
    path = Path(head).expanduser()
    if not path.exists():
        if _looks_like_local_path(head):
            return "an existing directory (this path does not exist) or a hub id like org/name"
        return None
    weights = path / "model.safetensors"
    if not path.is_dir() or not weights.is_file():
        return "a directory containing model.safetensors (an acceptance head)"
    shapes = read_safetensors_shapes(weights)
    outputs = {k: s for k, s in shapes.items() if len(s) == 2 and s[0] == 2}
    if not outputs:
        return ("a head whose output layer has shape [2, hidden] "
                f"(found {sorted(shapes.items())[:4]})")
    head_hidden = next(iter(outputs.values()))[1]
    draft_hidden = hidden_size if hidden_size is not None else _local_hidden_size(draft_model)
    if draft_hidden is not None and draft_hidden != head_hidden:
        return (f"a head for hidden size {draft_hidden} ({whose}); this head "
                f"expects hidden size {head_hidden}")
    return None


def _local_hidden_size(model: str | None) -> int | None:
    if model is None:
        return None
    cfg = Path(model).expanduser() / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text())
    data = data.get("text_config", data)
    return data.get("hidden_size")
