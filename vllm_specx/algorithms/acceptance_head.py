"""The SpecDec++ acceptance-prediction head: its module, file format and loader.

On the draft's final hidden state ``h`` (after the final norm), ``num_blocks`` residual blocks
``x + SiLU(W x + b)`` and then a ``Linear(H, 2)``; ``P(accept) = softmax(logits)[..., 1]``
(class 0 = reject, class 1 = accept). With ``shared_blocks`` ONE block (one ``W``, one ``b``)
is applied ``num_blocks`` times, which is what the SpecDec++ reference checkpoints are.

Files (a Hugging Face-style directory):

* ours: ``config.json`` with ``"format": "vllm-specx-acceptance-head"``, ``hidden_size``,
  ``num_blocks``, ``shared_blocks`` (plus free-form ``draft_model``, ``training``,
  ``metrics``), and ``model.safetensors`` with ``blocks.{i}.weight`` / ``blocks.{i}.bias``
  (only ``i = 0`` when shared) and ``output.weight`` ``[2, H]`` / ``output.bias`` ``[2]``.
* the reference layout (SpecDec++'s ``AcceptancePredictionHead`` saved by
  ``huggingface_hub``'s mixin): ``config.json`` = ``{"hidden_size": H, "num_layers": n}``;
  the module is ``nn.Sequential(*[block] * n, Linear(H, 2))`` with one shared ``block``, so
  ``model.safetensors`` holds ``model.0.linear.{weight,bias}`` (safetensors drops the
  aliases ``model.1..n-1``; if present they must equal ``model.0``) and
  ``model.{n}.{weight,bias}`` for the output layer. It loads as ``shared_blocks=True``.

Pure PyTorch (plus ``safetensors``), no vLLM import.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

HEAD_FORMAT = "vllm-specx-acceptance-head"
HEAD_FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class AcceptanceHead(nn.Module):
    """``n`` residual SiLU blocks then ``Linear(H, 2)``; see the module doc."""

    def __init__(self, hidden_size: int, num_blocks: int = 3, shared_blocks: bool = False) -> None:
        super().__init__()
        if hidden_size < 1 or num_blocks < 0:
            raise ValueError(
                f"hidden_size={hidden_size}, num_blocks={num_blocks}: need hidden_size >= 1 "
                "and num_blocks >= 0"
            )
        self.hidden_size = hidden_size
        self.num_blocks = num_blocks
        self.shared_blocks = shared_blocks
        # Shared: one Linear object; forward applies it num_blocks times (one parameter set).
        n_distinct = min(1, num_blocks) if shared_blocks else num_blocks
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(n_distinct))
        self.output = nn.Linear(hidden_size, 2)
        # Extra, free-form provenance carried into config.json by save_head.
        self.meta: dict[str, Any] = {}

    def block_sequence(self) -> list[nn.Linear]:
        """The linear layer of each applied block, in order (the same object when shared)."""
        if self.shared_blocks:
            return [self.blocks[0]] * self.num_blocks if self.num_blocks else []
        return list(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., 2]`` (reject, accept) for hidden states ``[..., H]``."""
        x = hidden.to(self.output.weight.dtype)
        for linear in self.block_sequence():
            x = x + nn.functional.silu(linear(x))
        return self.output(x)

    def accept_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """``P(accept)`` ``[...]`` in float32."""
        return torch.softmax(self.forward(hidden).float(), dim=-1)[..., 1]

    def config_dict(self) -> dict[str, Any]:
        return {
            "format": HEAD_FORMAT,
            "format_version": HEAD_FORMAT_VERSION,
            "hidden_size": self.hidden_size,
            "num_blocks": self.num_blocks,
            "shared_blocks": self.shared_blocks,
            **self.meta,
        }


def save_head(head: AcceptanceHead, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (float32) into ``directory``."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: param.detach().to("cpu", torch.float32).contiguous()
        for name, param in head.state_dict().items()
    }
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": HEAD_FORMAT})
    (out / CONFIG_NAME).write_text(json.dumps(head.config_dict(), indent=2, sort_keys=True) + "\n")
    return out


def _bad_head(path: Path, why: str) -> ValueError:
    return ValueError(f"acceptance head {str(path)!r}: {why}")


def load_head(
    directory: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> AcceptanceHead:
    """Load a head saved by :func:`save_head` or in the SpecDec++ reference layout."""
    from safetensors.torch import load_file

    path = Path(directory).expanduser()
    cfg_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not weights_file.is_file():
        raise _bad_head(path, f"no {WEIGHTS_NAME} in this directory")
    config: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    tensors = load_file(str(weights_file))
    if "output.weight" in tensors:
        head = _from_ours(path, config, tensors)
    elif any(re.fullmatch(r"model\.\d+\.weight", k) for k in tensors):
        head = _from_reference(path, config, tensors)
    else:
        raise _bad_head(path, f"unknown tensor names {sorted(tensors)[:6]}; expected "
                        "output.weight (vllm-specx) or model.N.weight (SpecDec++ reference)")
    return head.to(device=device, dtype=dtype).eval()


def _from_ours(
    path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> AcceptanceHead:
    hidden = int(tensors["output.weight"].shape[1])
    if config.get("hidden_size", hidden) != hidden:
        raise _bad_head(path, f"config hidden_size {config['hidden_size']} != weights {hidden}")
    n_stored = len({k.split(".")[1] for k in tensors if k.startswith("blocks.")})
    shared = bool(config.get("shared_blocks", False))
    num_blocks = int(config.get("num_blocks", n_stored))
    head = AcceptanceHead(hidden, num_blocks, shared)
    meta_keys = set(config) - {"format", "format_version", "hidden_size", "num_blocks",
                               "shared_blocks"}
    head.meta = {k: config[k] for k in sorted(meta_keys)}
    try:
        head.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise _bad_head(path, f"weights do not match its config ({num_blocks} blocks, shared="
                        f"{shared}, hidden {hidden}): {str(exc).splitlines()[0]}") from None
    return head


def _from_reference(
    path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> AcceptanceHead:
    # The output layer is the Sequential's last entry, index n = number of block applications.
    out_idx = [int(m.group(1)) for k in tensors if (m := re.fullmatch(r"model\.(\d+)\.weight", k))]
    if len(out_idx) != 1 or tensors[f"model.{out_idx[0]}.weight"].shape[0] != 2:
        raise _bad_head(path, "reference layout needs exactly one output layer model.N.weight "
                        "of shape [2, hidden]")
    n = out_idx[0]
    if "num_layers" in config and int(config["num_layers"]) != n:
        raise _bad_head(path, f"config num_layers {config['num_layers']} but the output layer "
                        f"is model.{n}")
    hidden = int(tensors[f"model.{n}.weight"].shape[1])
    blocks = {int(m.group(1)) for k in tensors
              if (m := re.fullmatch(r"model\.(\d+)\.linear\.weight", k))}
    if n and 0 not in blocks:
        raise _bad_head(path, f"{n} blocks but no model.0.linear.weight")
    # The reference applies one block object n times; any stored alias must be that block.
    for i in sorted(blocks - {0}):
        for part in ("weight", "bias"):
            alias, first = tensors[f"model.{i}.linear.{part}"], tensors[f"model.0.linear.{part}"]
            if not torch.equal(alias, first):
                raise _bad_head(path, f"model.{i}.linear.{part} differs from model.0: the "
                                "reference layout shares one block; this checkpoint does not")
    head = AcceptanceHead(hidden, n, shared_blocks=True)
    state = {
        "output.weight": tensors[f"model.{n}.weight"],
        "output.bias": tensors[f"model.{n}.bias"],
    }
    if n:
        state["blocks.0.weight"] = tensors["model.0.linear.weight"]
        state["blocks.0.bias"] = tensors["model.0.linear.bias"]
    head.load_state_dict(state, strict=True)
    head.meta = {"converted_from": "SpecDec++ reference layout"}
    return head
