"""A chain-drafting round reads nothing back from the device per pass (issue 36 item 1).

No GPU is needed: the round runs on CPU tensors, and the tensors a GPU would hold (the
draft's outputs, the sampling metadata, everything computed from them) are tagged with
:class:`DeviceTensor`, a ``torch.Tensor`` subclass that PyTorch propagates through every
op. What is counted is every way a tagged tensor's VALUES reach the host -- ``item``,
``tolist``, ``cpu``/``to("cpu")``, ``numpy``, ``bool``/``int``/``float``/``index``,
``nonzero``, ``masked_select``, ``unique`` and indexing by a tagged boolean mask -- i.e.
each place a CUDA run would synchronise. Host tensors the round builds itself (the live
request indices, pass metadata) are untagged and free, as they are on a GPU.

The round under test is the real ``ChainRound.draft_round`` (the ``adaptive`` /
``specx_mtp`` / ``specx_eagle3`` round) over a toy draft (logits = h @ W, feeding token t
gives hidden E[t]) and toy lookahead passes, so its drafts can be checked too.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from vllm_specx.algorithms.draft_stop import AlwaysContinue, DraftStopRule
from vllm_specx.glue.chain_drafter import ChainDraftStats, ChainRound
from vllm_specx.glue.draft_passes import RoundStart

# What reads a tensor's values on the host (a device sync on CUDA).
_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
          "nonzero", "masked_select", "unique", "argwhere"}


def _to_host(args: tuple, kwargs: dict) -> bool:
    targets = list(args[1:]) + [kwargs.get("device")]
    return any((isinstance(t, str) and t.startswith("cpu"))
               or (isinstance(t, torch.device) and t.type == "cpu") for t in targets)


class DeviceTensor(torch.Tensor):
    """A CPU tensor standing in for a device tensor; counts host reads of its values."""

    reads: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        read = name in _READS or (name == "to" and _to_host(args, kwargs))
        if name == "__getitem__" and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            read = read or any(isinstance(i, DeviceTensor) and i.dtype == torch.bool
                               for i in index)
        if not read:
            return super().__torch_function__(func, types, args, kwargs)
        cls.reads.append(name)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        # What comes back is a host value.
        return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out


def dev(t: torch.Tensor) -> DeviceTensor:
    return t.as_subclass(DeviceTensor)


V, H = 16, 8


class ToyModel:
    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w = dev(torch.randn(H, V, generator=g))
        self.embed = dev(torch.randn(V, H, generator=g))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.w


class ToyPasses:
    """Lookahead passes of the toy draft: feeding token t gives the hidden state E[t]."""

    def __init__(self, model: ToyModel) -> None:
        self.model = model
        self.rows_per_pass: list[int] = []

    def run(self, rows: torch.Tensor, tails: torch.Tensor, start: torch.Tensor,
            block_table: torch.Tensor | None = None) -> torch.Tensor:
        self.rows_per_pass.append(int(rows.numel()))
        return self.model.embed.index_select(0, tails[:, -1])


class ToyRound(ChainRound):
    """The real round over the toy draft (no vLLM proposer underneath)."""

    rule: DraftStopRule | None = None

    def __init__(self, settings: dict[str, Any], model: ToyModel) -> None:  # no super()
        self.settings = settings
        self.model = model
        self.stats = ChainDraftStats()
        self.head = None
        self._last_draft_probs = None
        self.toy_passes = ToyPasses(model)

    def stop_rule(self, k_max: int) -> DraftStopRule:
        return self.rule if self.rule is not None else super().stop_rule(k_max)

    def lookahead_passes(self, cad: Any, sample_positions: torch.Tensor,
                         base_seq_lens: torch.Tensor) -> ToyPasses:
        return self.toy_passes


def _run_round(k: int, settings: dict[str, Any], rule: DraftStopRule | None = None,
               num_reqs: int = 4, seed: int = 0) -> tuple[list[list[int]], list[str], ToyRound]:
    model = ToyModel(seed)
    rnd = ToyRound({"method": "adaptive", "num_speculative_tokens": k, **settings}, model)
    rnd.rule = rule
    out0 = dev(torch.randn(num_reqs, H, generator=torch.Generator().manual_seed(seed + 1)))
    positions = dev(torch.arange(num_reqs) + 10)
    start = RoundStart(k, num_reqs, out0, positions, None, num_reqs, positions + 1)
    md = SimpleNamespace(temperature=None, top_k=None, top_p=None, generators={},
                         all_greedy=True)
    DeviceTensor.reads = []
    drafts = rnd.draft_round(start, md)
    return drafts, list(DeviceTensor.reads), rnd


def _argmax_chain(model: ToyModel, out0: torch.Tensor, n: int) -> list[list[int]]:
    with torch._C.DisableTorchFunctionSubclass():
        rows = []
        for h in out0:
            chain = []
            for _ in range(n):
                t = int((h @ model.w).argmax())
                chain.append(t)
                h = model.embed[t]
            rows.append(chain)
        return rows


@pytest.mark.parametrize("fixed", ["min_eq_max", "always_continue"])
def test_a_fixed_length_round_reads_the_device_once_whatever_k(fixed: str) -> None:
    reads = {}
    for k in (2, 6):
        rule = AlwaysContinue(k) if fixed == "always_continue" else None
        drafts, reads[k], rnd = _run_round(k, {"min_speculative_tokens": k}, rule)
        # The drafts are the toy draft's argmax chains, K per request.
        out0 = torch.randn(4, H, generator=torch.Generator().manual_seed(1))
        assert drafts == _argmax_chain(rnd.model, out0, k)
        assert rnd.toy_passes.rows_per_pass == [4] * (k - 1)
    # The same reads at K = 2 and K = 6: none per pass; the drafts and their lengths
    # are read once, after the round.
    assert reads[2] == reads[6], reads
    assert len(reads[6]) <= 2, reads


def test_an_adaptive_round_reads_at_most_the_live_set_per_pass() -> None:
    # The confidence rule stops requests at different depths: the batch shrinks, and
    # the host must know which requests a pass carries -- one small read per pass.
    k = 6
    drafts, reads, rnd = _run_round(k, {"min_speculative_tokens": 1,
                                        "confidence_threshold": 0.35}, num_reqs=8, seed=3)
    lengths = [len(d) for d in drafts]
    assert len(set(lengths)) > 1, lengths  # the stops really were per request
    passes = len(rnd.toy_passes.rows_per_pass)
    assert rnd.toy_passes.rows_per_pass == sorted(rnd.toy_passes.rows_per_pass, reverse=True)
    # A round decides K_max - 1 times at most; each decision is one read of the live
    # set, plus the one read of the drafts at the end.
    assert len(reads) <= min(passes + 1, k - 1) + 2, reads


def test_the_counter_sees_a_per_pass_read() -> None:
    # The counting method is not blind: a round that reads each pass's tokens back
    # (what the round did before issue 36) is caught.
    class ReadingPasses(ToyPasses):
        def run(self, rows, tails, start, block_table=None):  # type: ignore[override]
            tails.tolist()
            return super().run(rows, tails, start, block_table)

    reads = {}
    for k in (2, 6):
        model = ToyModel(0)
        rnd = ToyRound({"method": "adaptive", "num_speculative_tokens": k,
                        "min_speculative_tokens": k}, model)
        rnd.toy_passes = ReadingPasses(model)
        out0 = dev(torch.randn(4, H))
        pos = dev(torch.arange(4))
        DeviceTensor.reads = []
        rnd.draft_round(RoundStart(k, 4, out0, pos, None, 4, pos + 1),
                        SimpleNamespace(temperature=None, top_k=None, top_p=None,
                                        generators={}, all_greedy=True))
        reads[k] = len(DeviceTensor.reads)
    assert reads[6] - reads[2] == 4
