"""The acceptance head: forward pass against a manual computation, our file format, and the
SpecDec++ reference layout (ONE block object applied n times) loaded with its sharing."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from vllm_specx.algorithms.acceptance_head import AcceptanceHead, load_head, save_head
from vllm_specx.config import acceptance_head_problem


def _manual(x: torch.Tensor, blocks: list[tuple[torch.Tensor, torch.Tensor]],
            out_w: torch.Tensor, out_b: torch.Tensor) -> torch.Tensor:
    """P(accept) written out: x <- x + silu(W x + b) per block, then softmax(Wo x + bo)[1]."""
    x = x.double()
    for w, b in blocks:
        z = x @ w.double().T + b.double()
        x = x + z * torch.sigmoid(z)
    logits = x @ out_w.double().T + out_b.double()
    return torch.exp(logits[..., 1]) / torch.exp(logits).sum(-1)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("num_blocks", [0, 1, 3])
def test_forward_matches_manual_and_roundtrips(tmp_path, shared, num_blocks):
    torch.manual_seed(0)
    head = AcceptanceHead(8, num_blocks, shared)
    head.meta = {"draft_model": {"name": "d"}}
    x = torch.randn(5, 8)
    blocks = [(lin.weight, lin.bias) for lin in head.block_sequence()]
    assert len(blocks) == num_blocks
    want = _manual(x, blocks, head.output.weight, head.output.bias)
    torch.testing.assert_close(head.accept_prob(x).double(), want, rtol=1e-5, atol=1e-6)
    n_params = sum(p.numel() for p in head.parameters())
    distinct = (1 if num_blocks else 0) if shared else num_blocks
    assert n_params == distinct * (8 * 8 + 8) + 2 * 8 + 2

    save_head(head, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["num_blocks"] == num_blocks and cfg["shared_blocks"] is shared
    assert cfg["draft_model"] == {"name": "d"}
    loaded = load_head(tmp_path / "h")
    assert loaded.shared_blocks is shared and loaded.meta == head.meta
    torch.testing.assert_close(loaded.accept_prob(x), head.accept_prob(x))


class _RefBlock(nn.Module):
    # The reference's block layout: a submodule named `linear`, residual SiLU.
    def __init__(self, h: int) -> None:
        super().__init__()
        self.linear = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class _RefHead(nn.Module):
    def __init__(self, h: int, n: int) -> None:
        super().__init__()
        block = _RefBlock(h)
        self.model = nn.Sequential(*([block] * n), nn.Linear(h, 2))  # one block, n times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


@pytest.mark.parametrize("keep_aliases", [False, True])
def test_loads_reference_layout_with_shared_block(tmp_path, keep_aliases):
    from safetensors.torch import save_file, save_model

    torch.manual_seed(1)
    h, n = 6, 3
    ref = _RefHead(h, n)
    out = tmp_path / "ref"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"hidden_size": h, "num_layers": n}))
    if keep_aliases:
        # A state_dict dump keeps model.0/1/2.linear.* as equal copies.
        save_file({k: v.clone().contiguous() for k, v in ref.state_dict().items()},
                  str(out / "model.safetensors"))
    else:
        save_model(ref, str(out / "model.safetensors"))  # what huggingface_hub's mixin writes
    head = load_head(out)
    assert head.shared_blocks and head.num_blocks == n
    # One parameter set: one block Linear plus the output layer.
    assert len(list(head.parameters())) == 4
    seq = head.block_sequence()
    assert len(seq) == n and all(b is seq[0] for b in seq)
    x = torch.randn(4, h)
    w, b = ref.model[0].linear.weight, ref.model[0].linear.bias
    want = _manual(x, [(w, b)] * n, ref.model[n].weight, ref.model[n].bias)
    torch.testing.assert_close(head.accept_prob(x).double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.forward(x), ref(x).detach(), rtol=1e-5, atol=1e-6)
    # Changing the one shared weight moves every application.
    with torch.no_grad():
        head.blocks[0].weight.mul_(2)
    want2 = _manual(x, [(2 * w, b)] * n, ref.model[n].weight, ref.model[n].bias)
    torch.testing.assert_close(head.accept_prob(x).double(), want2, rtol=1e-5, atol=1e-6)
    # config.py's pre-engine check accepts this layout (an output tensor of shape [2, H]).
    assert acceptance_head_problem(str(out), draft_model=None) is None


def test_reference_layout_with_unshared_aliases_is_refused(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(2)
    ref = _RefHead(4, 2)
    state = {k: v.clone().contiguous() for k, v in ref.state_dict().items()}
    state["model.1.linear.weight"] = state["model.1.linear.weight"] + 1.0
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="differs from model.0"):
        load_head(tmp_path)


def test_saved_head_passes_and_fails_the_engine_check(tmp_path):
    from vllm_specx.fixtures import fixture_model_dirs

    _, draft = fixture_model_dirs()
    hidden = json.loads((draft / "config.json").read_text())["hidden_size"]
    save_head(AcceptanceHead(hidden, 1), tmp_path / "ok")
    assert acceptance_head_problem(str(tmp_path / "ok"), draft_model=str(draft)) is None
    save_head(AcceptanceHead(hidden + 8, 1), tmp_path / "bad")
    problem = acceptance_head_problem(str(tmp_path / "bad"), draft_model=str(draft))
    assert problem is not None and f"hidden size {hidden}" in problem
