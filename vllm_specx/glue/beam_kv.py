"""KV slots of their own for MTAD's beams (vLLM glue, checked on vLLM 0.32 V1).

The B beams of one request write different tokens at the same lookahead positions
``P+1 .. P+K-1``. To run all beams of a depth in ONE draft forward pass, every beam needs
its own KV slots for its tail. How (numbers in docs/methods/mtad.md, "Draft cost"):

* **A block-aligned scratch region, reserved at start.** The scheduler is told the KV
  cache has ``R`` blocks fewer than the workers allocated (:class:`BeamScratchReservation`);
  the workers use the last ``R`` block ids, which the scheduler therefore never hands to a
  request. Memory stays inside what the engine reserved at start, nothing is allocated
  per round, and the scheduler's accounting (admission, preemption, prefix caching) only
  ever sees blocks it owns. ``R = max_num_seqs * (B - 1) * span`` blocks, ``span`` the
  blocks one tail can touch (1 or 2 when ``K - 1 <= block_size``), capped at 1/8 of the
  cache or, if more, what leaves room for ``max_num_seqs`` requests of ``max_model_len``.
* **Per-beam block-table rows.** Beam slot 0 of a request is the request's own block-table
  row (the lookahead slots chain drafting writes, so B = 1 is chain drafting exactly).
  Slot s >= 1 gets a copy of that row whose blocks covering ``P+1 .. P+K-1`` point into
  the scratch region; the request's last, partial block (positions up to P are real
  context) is copied into the slot's first scratch block once per round
  (copy-on-write), in the draft layers' caches only.

An attention mask over the beam tree (tree attention) would need no copy, but no vLLM 0.32
attention backend takes a per-token mask for paged decode (tree attention was removed
upstream), and rows with block tables are what every backend already runs.

When the region cannot hold a round's beams (more requests than ``max_num_seqs``, or B
raised on a running engine), the drafter runs the beams in groups of requests that fit
(more passes, same drafts); with no region (a cache with several block sizes, a kernel
block size other than the scheduler's) it recomputes the tails one beam per pass.

vLLM private names relied on here: ``DraftModelProposer._draft_attn_layer_names``,
``GPUModelRunner.kv_cache_config``, ``Scheduler.__init__``'s ``kv_cache_config``.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

from vllm_specx.config import specx_settings
from vllm_specx.glue.patch_base import VllmPatch
from vllm_specx.methods import METHODS, draft_model_tree

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: the scheduler patch below is registered by the
# plugin in every process, which must stay cheap to import.

logger = logging.getLogger("vllm.specx")

# Never take more than this share of the KV cache for beam scratch blocks.
MAX_SCRATCH_SHARE = 8


def uniform_block_size(kv_cache_config: Any) -> int | None:
    """The block size shared by every KV cache group, or None when they differ."""
    sizes = {
        getattr(group.kv_cache_spec, "block_size", None)
        for group in kv_cache_config.kv_cache_groups
    }
    if len(sizes) != 1:
        return None
    (size,) = sizes
    return size if isinstance(size, int) and size > 0 else None


def beam_scratch_blocks(vllm_config: Any, kv_cache_config: Any) -> int:
    """Blocks reserved for beam tails (0 without a beam drafter, or with B = 1 or K = 1;
    the method's spec names its beam width knob: ``MethodSpec.beam_width_knob``).

    A pure function of the engine's configuration and the workers' KV cache config, so
    the scheduler (which hides them) and the workers (which use them) agree on it.
    """
    settings = specx_settings(vllm_config)
    method = METHODS.get(settings.get("method", "")) if settings else None
    tree = draft_model_tree(settings) if settings else None
    if method is None or (method.beam_width_knob is None and tree is None):
        return 0
    spec_config = getattr(vllm_config, "speculative_config", None)
    # The beams' depth: the specx setting (with draft_tree vLLM's K is the tree's node
    # budget, not the depth); vLLM's own K where the settings carry none. A draft-model
    # tree (adaptive's draft_tree) is drafted by the same beam passes: branching x depth.
    k = (settings.get("num_speculative_tokens")
         or getattr(spec_config, "num_speculative_tokens", None))
    if tree is not None:
        k = tree["max_depth"]
    block_size = uniform_block_size(kv_cache_config)
    if not k or block_size is None:
        return 0
    from vllm_specx.algorithms.beam_tails import beam_tail_span_blocks

    beams = int(tree["branching"] if tree is not None else settings[method.beam_width_knob])
    per_request = (beams - 1) * beam_tail_span_blocks(int(k), block_size)
    max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
    want = max_num_seqs * per_request
    # Take at most 1/8 of the cache, or more while the scheduler keeps room for
    # max_num_seqs requests of max_model_len (small CPU caches, wide beams).
    num_blocks = int(kv_cache_config.num_blocks)
    full_requests = max_num_seqs * -(-int(vllm_config.model_config.max_model_len) // block_size)
    cap = max(num_blocks // MAX_SCRATCH_SHARE, num_blocks - full_requests)
    return max(0, min(want, cap))


class BeamScratchReservation(VllmPatch):
    name = "mtad_beam_scratch_reservation"
    target = "vllm.v1.core.sched.scheduler:Scheduler.__init__"
    replaces = (
        "Scheduler.__init__, which builds the KV cache manager from kv_cache_config "
        "(num_blocks: the blocks it may hand out)"
    )
    why = (
        "MTAD runs all beams of a depth in one draft pass; each beam's tail needs KV "
        "slots of its own. The scheduler gets num_blocks - R so the last R blocks the "
        "workers allocated stay a scratch region no request ever owns (inside the "
        "engine's KV memory, nothing allocated per round)"
    )
    lazy = True

    def wrap(self, original: Any) -> Any:
        def __init__(self_: Any, vllm_config: Any, kv_cache_config: Any, *args: Any,
                     **kw: Any) -> None:
            reserve = beam_scratch_blocks(vllm_config, kv_cache_config)
            if reserve:
                kv_cache_config = copy.deepcopy(kv_cache_config)
                kv_cache_config.num_blocks -= reserve
                logger.info(
                    "vllm-specx %s: %d of %d KV blocks reserved for beam tails",
                    specx_settings(vllm_config)["method"], reserve,
                    kv_cache_config.num_blocks + reserve,
                )
            original(self_, vllm_config, kv_cache_config, *args, **kw)

        return __init__


class BeamKVSlots:
    """The worker side: the scratch region's block ids, per-beam block-table rows and the
    copy-on-write of each request's partial block. Built lazily by the drafter (the KV
    cache exists only after ``initialize_kv_cache``)."""

    def __init__(self, proposer: Any) -> None:
        import torch

        kv_config = proposer.model_runner.kv_cache_config
        self.num_blocks = int(kv_config.num_blocks)
        self.block_size = uniform_block_size(kv_config)
        reserve = beam_scratch_blocks(proposer.vllm_config, kv_config)
        self.reason: str | None = None
        if self.block_size is None:
            self.reason = "KV cache groups with different block sizes"
        elif self.block_size != proposer.block_size:
            self.reason = "the attention kernel's block size differs from the scheduler's"
        self.device = proposer.device
        ctx = proposer.vllm_config.compilation_config.static_forward_context
        # (tensor, block dim) of every draft attention layer's cache.
        self.caches: list[tuple[torch.Tensor, int]] = []
        for name in sorted(proposer._draft_attn_layer_names):
            kv = ctx[name].kv_cache
            dims = [d for d, n in enumerate(kv.shape) if n == self.num_blocks]
            if not dims:
                self.reason = f"draft layer {name}'s KV cache has no block dimension"
                break
            self.caches.append((kv, dims[0]))
        self.pool = torch.arange(
            self.num_blocks - reserve, self.num_blocks, device=self.device, dtype=torch.int64
        )
        if self.reason is None and reserve == 0:
            self.reason = "no scratch region reserved"

    @property
    def usable(self) -> bool:
        return self.reason is None

    def requests_per_group(self, num_beams: int, k: int) -> int:
        """Requests whose beams fit the region at once (0: not even one request's)."""
        from vllm_specx.algorithms.beam_tails import beam_tail_span_blocks

        per_request = (num_beams - 1) * beam_tail_span_blocks(k, self.block_size or 1)
        if per_request == 0:
            return 1 << 30
        return len(self.pool) // per_request

    def beam_block_tables(
        self,
        block_table: torch.Tensor,
        sample_positions: torch.Tensor,
        num_beams: int,
        k: int,
        copy_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[n, B, W] block-table rows for beam slots of ``n`` requests (their own rows
        ``block_table`` [n, W], their positions P ``sample_positions`` [n]) and copy each
        request's partial block into its slots' first scratch block (``copy_rows``, bool
        [n]: only those requests'; a request that runs no lookahead pass, such as one that
        cost control stops at depth 0 or 1, reads no scratch slot).

        The caller guarantees the region holds ``n * (B - 1) * span`` blocks.
        """
        import torch

        from vllm_specx.algorithms.beam_tails import beam_tail_span_blocks

        n, width = block_table.shape
        span = beam_tail_span_blocks(k, self.block_size)
        rows = block_table.unsqueeze(1).repeat(1, num_beams, 1)
        if num_beams == 1 or span == 0:
            return rows
        dev = block_table.device
        first = (sample_positions.to(dev, torch.int64) + 1) // self.block_size  # [n]
        scratch = self.pool[: n * (num_beams - 1) * span].view(n, num_beams - 1, span)
        cols = first.view(n, 1, 1) + torch.arange(span, device=dev).view(1, 1, span)
        cols = cols.expand(n, num_beams - 1, span)
        in_table = cols < width
        cols = cols.clamp(max=width - 1)
        current = rows[:, 1:].gather(2, cols)
        rows[:, 1:].scatter_(2, cols, torch.where(in_table, scratch.to(rows.dtype), current))
        # Copy-on-write: the request's block holding P+1 also holds real context
        # (positions below P+1) unless P+1 starts it.
        partial = ((sample_positions.to(dev, torch.int64) + 1) % self.block_size != 0)
        partial &= first < width
        if copy_rows is not None:
            partial &= copy_rows.to(dev, torch.bool)
        src = block_table.gather(1, first.clamp(max=width - 1).view(n, 1)).to(torch.int64)
        partial = partial.view(n, 1).expand(n, num_beams - 1)
        src = src.expand(n, num_beams - 1)[partial]
        dst = scratch[:, :, 0][partial]
        if src.numel():
            for kv, dim in self.caches:
                kv.index_copy_(dim, dst, kv.index_select(dim, src))
        return rows
