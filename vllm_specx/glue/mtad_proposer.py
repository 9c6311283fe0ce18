"""MTAD drafting inside vLLM: beam search of width B and depth K in the draft model.

``MTADProposer`` is vLLM's ``DraftModelProposer`` (checked on vLLM 0.32.0, V1 model
runner) with a different round (``draft_round``, after the first pass that the specx
proposers share: ``glue/draft_passes.SpecxPasses``): instead of one chain of K tokens it
runs, for every request of the batch, the beam search of
``vllm_specx.algorithms.beam_draft`` and returns the best beam's K tokens,
``[num_reqs, K]`` like the base class. The chosen beam's per-token draft probabilities
``q_j`` are left for ``take_last_draft_probs()`` as a ``[num_reqs, K]`` float32 tensor;
the runner slices ``[row, :num_draft]`` per request and concatenates them into the 1-D
``[T]`` tensor the specx sampler's MTAD rule reads.

Draft passes: K per round, for every B
--------------------------------------
The search is the pure ``beam_search_batched``; this module is its model callback.

* The first pass is exactly the base class's (the target's verified tokens plus the new
  token, one pass for the whole batch) and gives every request's first-token logits.
* At depth ``j`` (1..K-1) ONE pass carries every live beam of every request (a request
  whose beams died carries fewer): beam b's ``j``-token tail sits at positions
  ``P+1 .. P+j`` (``P``: the position of the token the target just emitted) in KV slots
  of its own, so beams of one request no longer overwrite each other. How the slots are
  found inside the engine's KV cache (a scratch region reserved at start, per-beam
  block-table rows, copy-on-write of the partial block) is ``glue/beam_kv.py``.
  Beam slot 0 is the request's own lookahead slots (what chain drafting writes), so at
  B = 1 the drafter does exactly what chain drafting does.
* Each new beam goes to its parent's slot when it is the parent's first child (it then
  feeds one token); its siblings go to free slots and feed their tail from where it
  differs from what that slot holds (``beam_tails.assign_beam_slots`` and
  ``tail_feed_start``). A pass splits only when it does not fit the drafter's token
  buffers.

When the scratch region cannot hold every beam of the round (B raised on a running
engine, more requests than ``max_num_seqs``), requests run in groups that fit (one pass
per group and depth; a group's scratch slots are re-copied and its tails re-fed). With no
region at all the drafter falls back to "recompute the tail": one pass per beam per depth
over the request's own lookahead slots, visiting siblings back to back and skipping the
prefix already in the slots (``1 + B*(K-1)`` passes per round).

Nothing is allocated per round, and the slots the scheduler owns are written exactly as
with ``method="draft_model"`` (the scratch blocks are never a request's), so prefix
caching, chunked prefill and preemption see the same KV-cache bookkeeping: the next
round's first pass rewrites the draft KV of every verified token anyway.

Warping: each request's own temperature, top-k and top-p (vLLM's order); greedy requests
(temperature 0) run deterministic top-B beam search on the unwarped draft log-probs.
Seeded requests draw from their own ``torch.Generator``. Not applied to the draft (as in
vLLM's own drafter): penalties, bad words, logit bias and other logits processors.

Heterogeneous vocabularies (``use_heterogeneous_vocab``, a draft with another
tokenizer): the base class builds vLLM's ``VocabMapping`` and its first pass already
feeds the draft the target's tokens translated into draft ids. The beam search then runs
entirely in draft ids (the tails it writes are draft tokens) on draft logits constrained
to the shared vocabulary, so every beam is expressible in the target's vocabulary; only
the chosen beam is translated into target ids. The draft probabilities ``q_j`` stay the
draft's own (renormalised over the shared vocabulary): the MTAD rule needs only the
chosen tokens' probabilities, not a distribution over the target's vocabulary, which is
why sampled requests work here while vLLM's own hetero-vocab drafting is greedy-only.

Not supported (refused at construction with the reason): parallel drafting, data
parallelism, decode context parallelism and M-RoPE draft models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_specx.algorithms.beam_draft import (
    SAMPLING_EPS,
    BeamLogprobs,
    BeamSearchState,
    beam_search_batched,
    greedy_mask_from_temperature,
    recompute_tail_cost,
    warp_logprobs,
)
from vllm_specx.algorithms.beam_tails import (
    assign_beam_slots,
    split_rows_by_token_budget,
    tail_feed_start,
)
from vllm_specx.algorithms.draft_stop import AlwaysContinue
from vllm_specx.glue.beam_kv import BeamKVSlots
from vllm_specx.glue.cost_model import (
    CostControl,
    RoundPlan,
    cost_control_for,
    cost_control_stats,
    retired_requests,
)
from vllm_specx.glue.draft_passes import RoundStart, SpecxDraftModelProposer
from vllm_specx.glue.proposer_contract import refuse_unsupported_options
from vllm_specx.glue.sampled_tree_round import (
    sampled_children_on,
    sampled_tree_depths,
    sampled_tree_round,
    wants_sampled_tree,
)
from vllm_specx.glue.tree_cost import (
    TreeCostControl,
    TreeRoundPlan,
    apply_keep,
    requests_that_may_draft,
    tree_cost_control_for,
    tree_cost_stats,
)
from vllm_specx.methods import GREEDY_DRAFTING, draft_model_tree

logger = logging.getLogger("vllm.specx")


@dataclass
class MTADDraftStats:
    """Draft-model work of the MTAD drafter; ``specx_stats()`` hands it to the bench.

    ``first_pass_tokens``: the base-class pass over the verified tokens (what vanilla
    draft-model drafting also spends). ``tail_tokens``: tokens fed at depths 1..K-1
    (vanilla: ``num_reqs * (K-1)``). ``full_recompute_tail_tokens``: what the tail passes
    would cost without KV-prefix reuse (``B*K*(K-1)/2`` per request).
    ``tail_forward_passes``: batched passes at depths 1..K-1; ``request_passes``: the
    passes each request took part in, summed over requests (first pass included: K per
    request-round when the beams fit one pass per depth).
    """

    rounds: int = 0
    requests: int = 0  # sum over rounds of the requests drafted for
    drafted_tokens: int = 0
    first_pass_tokens: int = 0
    tail_tokens: int = 0
    tail_forward_passes: int = 0
    full_recompute_tail_tokens: int = 0
    request_passes: int = 0
    sequential_rounds: int = 0  # rounds run one beam per pass (no scratch region)
    tree_nodes: int = 0  # draft_tree: nodes of the drafted trees (drafted_tokens: K each)

    def record(
        self,
        num_reqs: int,
        k: int,
        b: int,
        first: int,
        tail: int,
        passes: int,
        request_passes: int | None = None,
        sequential: bool = False,
        drafted: int | None = None,
    ) -> None:
        full = num_reqs * recompute_tail_cost(b, k)
        self.rounds += 1
        self.requests += num_reqs
        # ``drafted``: the round's tokens when requests drafted to their own depths.
        self.drafted_tokens += num_reqs * k if drafted is None else drafted
        self.first_pass_tokens += first
        self.tail_tokens += tail
        self.tail_forward_passes += passes
        self.full_recompute_tail_tokens += full
        # Without a count, every request took part in every pass of the round.
        self.request_passes += num_reqs * (1 + passes) if request_passes is None else (
            request_passes)
        self.sequential_rounds += int(sequential)

    def as_dict(self) -> dict[str, Any]:
        # drafted/scheduled/draft_forward_passes/requests are the keys the bench reads
        # (``bench.metrics.DrafterStats``): every request of a round is scheduled its K
        # drafts, and its draft forwards are the passes it took part in.
        return {
            "drafted_tokens": self.drafted_tokens,
            "scheduled_tokens": self.drafted_tokens,
            "draft_forward_passes": self.request_passes,
            "rounds": self.rounds,
            "requests": self.requests,
            "batched_forward_passes": self.rounds + self.tail_forward_passes,
            "first_pass_tokens": self.first_pass_tokens,
            "tail_tokens": self.tail_tokens,
            "tail_forward_passes": self.tail_forward_passes,
            "full_recompute_tail_tokens": self.full_recompute_tail_tokens,
            "sequential_rounds": self.sequential_rounds,
            "tree_nodes": self.tree_nodes,
        }


class MTADRound:
    """The MTAD round (beam search after the first pass) over no runner: mixed into vLLM's
    V1 draft-model proposer as :class:`MTADProposer`, and into a Model Runner V2
    speculator (``glue/v2_speculators.py``), which supplies ``model``, ``settings``,
    ``lookahead_passes``, ``_beam_slots`` and the round's ``RoundStart``."""

    # Skip recomputing the part of a beam's tail already in the lookahead slots.
    reuse_kv_prefix: bool = True
    # All beams of a depth in one pass (their own KV slots); False: one pass per beam in
    # the request's own lookahead slots, the drafter before batching (for comparison).
    batched_beams: bool = True

    # The validated mtad settings (``num_beams``, ``acceptance_threshold``, ...): set by
    # the runner hook (vllm_specx.glue.runner_hook) right after construction.
    settings: dict[str, Any]

    model: Any
    device: torch.device
    max_num_tokens: int
    use_heterogeneous_vocab: bool
    _last_draft_probs: torch.Tensor | None

    # Draft trees: the runner's TreeState (glue/tree_step.py), set by the runner hook
    # when ``draft_tree`` is on; None drafts the single best beam.
    tree_state: Any = None

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)  # type: ignore[call-arg]
        self._refuse_unsupported(vllm_config)
        self.stats = MTADDraftStats()
        # Position P of the token each request's draft continues (last round), for
        # tests and debugging: the draft context is the request's tokens [0, P].
        self.last_sample_positions: torch.Tensor | None = None
        self._slots: BeamKVSlots | None = None
        # The model runner: its KV cache config locates the beams' scratch region.
        self.model_runner = runner
        # SpecxPasses.propose reads the batch's request ids off ``runner`` (cost control).
        if getattr(self, "runner", None) is None:
            self.runner = runner
        self._cost_control: CostControl | None = None

    @property
    def num_beams(self) -> int:
        """Beam width B, from the validated settings."""
        return int(self.settings["num_beams"])

    @property
    def greedy_chain(self) -> bool:
        """Greedy rows draft the argmax chain (width 1) instead of the B-wide beam search
        (``greedy_drafting: "chain"``; docs/methods/mtad.md: accepted more often at T = 0)."""
        return self.settings.get("greedy_drafting", GREEDY_DRAFTING.default) == "chain"

    @greedy_chain.setter
    def greedy_chain(self, value: bool) -> None:
        self.settings = {**self.settings, "greedy_drafting": "chain" if value else "beam"}

    @num_beams.setter
    def num_beams(self, value: int) -> None:
        # Tests and the draft-cost script sweep B on one running engine.
        self.settings = {**self.settings, "num_beams": int(value)}

    def _refuse_unsupported(self, vllm_config: Any) -> None:
        # A draft with another tokenizer is supported here (drafts stay in the shared
        # vocabulary); decode context parallelism shards each request's KV over ranks,
        # which the beams' own KV slots do not follow.
        parallel = vllm_config.parallel_config
        refuse_unsupported_options(
            self, vllm_config, "MTAD drafting",
            ["decode context parallelism (KV shards per rank)"]
            if getattr(parallel, "decode_context_parallel_size", 1) > 1 else [],
        )

    # ----------------------------------------------------------------------------------
    # cost control (issue 32): every request's own depth per step
    # ----------------------------------------------------------------------------------

    def cost_control(self, k_max: int) -> CostControl | None:
        """The round's cost control, or None (``cost_control`` off, draft trees, or tensor /
        pipeline parallelism: every rank must draft in lockstep and each rank's clock
        differs)."""
        if self.tree_state is not None:
            return None
        return cost_control_for(self, k_max)

    def plan_before_first_pass(
        self, k: int, req_ids: tuple[str, ...], num_rejected: torch.Tensor | None,
        target_tokens: int,
    ) -> Any:
        """Every request's depth for the step, chosen before the first pass (V1
        ``SpecxPasses.propose``, V2 ``SpecxV2DraftSpeculator.propose``): the beam search
        runs each request to its own depth (``row_depth``), and a request leaves the
        lookahead passes once its depth is reached (depth 0: no logits, no lookahead
        rows). All zero skips the first pass (a plain decode step; ``DraftKVHoles``
        catches the draft KV up later). A request carries its ``B`` beams in each pass it
        takes part in, one under ``greedy_drafting: "chain"`` when it is greedy."""
        if self.tree_state is not None:
            return self._plan_tree_before_first_pass(k, req_ids, num_rejected, target_tokens)
        control = self.cost_control(k)
        if control is None:
            return None
        control.begin(req_ids, num_rejected, target_tokens)
        if not self.controls_batch(req_ids):
            # "greedy" and a sampled request in the batch: every request drafts K, as with
            # the control off (a retired one nothing: its draft KV has holes). The step is
            # still timed and its acceptance learnt.
            gone = retired_requests(self)
            caps = torch.tensor([0 if rid in gone else k for rid in req_ids],
                                dtype=torch.int64)
            return RoundPlan(AlwaysContinue(max(k, 1)), caps, 0.0)
        caps = torch.as_tensor(control.plan_depths(req_ids, k, self._plan_widths(req_ids)),
                               dtype=torch.int64)
        nobody = not bool(caps.any())
        deepest = int(caps.max()) if caps.numel() else 0
        plan = RoundPlan(AlwaysContinue(max(deepest, 1)), caps, 0.0, skip_first_pass=nobody)
        if nobody:
            control.end(req_ids, [0] * len(req_ids), 0, 0)
        return plan

    def controls_batch(self, req_ids: Sequence[str]) -> bool:
        """Whether the cost control weighs this batch's drafts: always with
        ``"cost_control": true`` (the default); under ``"greedy"`` only when every request
        is greedy (known to be: a runner that does not say counts as sampled), because
        greedy requests are verified greedily, so their depth changes their speed and never
        their output, while a sampled request's output depends on how deep mtad drafts.
        A batch the control does not weigh drafts as configured and retires nobody
        (``DraftKVHoles.admit``)."""
        if self.settings.get("cost_control") != "greedy":
            return True
        return len(req_ids) > 0 and self._all_greedy(req_ids) is True

    def _all_greedy(self, req_ids: Sequence[str]) -> bool | None:
        """Whether every request of the batch is greedy; None where the runner does not
        say (:meth:`_greedy_requests`)."""
        greedy = self._greedy_requests(tuple(req_ids))
        return None if greedy is None else bool(greedy.all())

    def _plan_widths(self, req_ids: tuple[str, ...]) -> np.ndarray:
        """The beam rows each request carries per lookahead pass: ``B``, or 1 for a greedy
        request under ``greedy_drafting: "chain"``. Greedy-ness is read from the runner's
        request states (before the first pass there is no sampling metadata yet); where
        a runner does not say, ``B`` (an upper bound: never too deep for its cost)."""
        b = self.num_beams
        widths = np.full(len(req_ids), b, dtype=np.int64)
        if b > 1 and self.greedy_chain:
            greedy = self._greedy_requests(req_ids)
            if greedy is not None:
                widths[greedy] = 1
        return widths

    def _greedy_requests(self, req_ids: tuple[str, ...]) -> np.ndarray | None:
        """Which requests are greedy (temperature 0), or None where the runner does not
        say: V1's ``input_batch.greedy_reqs``, V2's sampling states by request row."""
        runner = self.model_runner
        greedy_reqs = getattr(getattr(runner, "input_batch", None), "greedy_reqs", None)
        if greedy_reqs is not None:  # V1
            return np.array([rid in greedy_reqs for rid in req_ids], dtype=bool)
        states = getattr(getattr(runner, "sampler", None), "sampling_states", None)
        index = getattr(getattr(runner, "req_states", None), "req_id_to_index", None)
        if states is None or index is None:
            return None
        temperature = states.temperature.np  # V2: per request-state row
        return np.array([temperature[index[rid]] < SAMPLING_EPS for rid in req_ids],
                        dtype=bool)

    # ----------------------------------------------------------------------------------
    # the round after the first pass
    # ----------------------------------------------------------------------------------

    def _beam_round(
        self, start: RoundStart, sampling_metadata: SamplingMetadata
    ) -> torch.Tensor | list[list[int]]:
        """The beam search to the plan's depths (all K without a plan); with a tree, its
        beams verified as one tree (:meth:`_tree_round`)."""
        k, num_reqs = start.k, start.num_reqs
        if self.tree_state is not None:
            # vLLM's K is the tree's node budget; the beams' depth is the specx K.
            k = min(k, int(self.settings["num_speculative_tokens"]))
        cad, sample_positions = start.cad, start.sample_positions
        base_seq_lens = start.base_seq_lens
        plan = start.plan
        # Per-request depths (cost control): each request's beam search stops at its own
        # depth and leaves the later passes; None: every request runs K deep.
        row_depth: torch.Tensor | None = None
        if plan is not None:
            k = min(k, int(plan.caps.max()) if plan.caps.numel() else 0)
            if not bool((plan.caps >= k).all()):
                row_depth = plan.caps.clamp(max=k)
        self.last_sample_positions = sample_positions
        if k == 0 and plan is not None:
            # The depth control planned 0 and the first pass ran all the same: no logits,
            # no round, and the plan already ended the control's round; the empty lists
            # tell the scheduler (V2: take_draft_lengths) there is no draft.
            return [[] for _ in range(num_reqs)]
        if row_depth is not None and not bool((row_depth > 0).all()):
            # Requests planned at depth 0: no logits (their rows stay 0: any finite
            # values, the search gives them no live beam).
            drafting = (row_depth > 0).nonzero().squeeze(1).to(start.out.device)
            logits = _into_rows(self.model.compute_logits(start.out[drafting]), drafting,
                                num_reqs)
        else:
            logits = self.model.compute_logits(start.out)
        if k == 0:
            if self._cost_control is not None:
                # A step without a round: the next interval would span two steps.
                self._cost_control.costs.forget_interval()
            return start.no_drafts()

        greedy = greedy_mask_from_temperature(
            sampling_metadata.temperature, num_reqs, device=logits.device
        )
        generators = sampling_metadata.generators or None

        mapping = self.vocab_mapping if self.use_heterogeneous_vocab else None

        def warp(lg: torch.Tensor) -> torch.Tensor:
            md = sampling_metadata
            if mapping is not None:
                # Draft-only tokens have no target id: no beam may contain one.
                lg = mapping.constrain_draft_logits(lg)
            if md.temperature is None:
                # All greedy: vLLM may still carry top-k/top-p rows for them, but greedy
                # beam search ranks by the unwarped draft log-probs.
                return warp_logprobs(lg)
            return warp_logprobs(lg, md.temperature, md.top_k, md.top_p)

        b = self.num_beams
        slots = self._beam_slots() if self.batched_beams else None
        # Requests whose beams fit the scratch region at once (B = 1 needs none).
        group_size = num_reqs if b == 1 else 0
        if slots is not None and b > 1:
            group_size = min(slots.requests_per_group(b, k), num_reqs)
            if self.device.type != "cpu":
                # GPU attention builders size per-request buffers by max_num_seqs (FlashInfer's
                # indptr, full-CUDA-graph metadata): a pass over group_size * B beam rows must
                # not exceed it. The CPU builders have no such buffers (tests run B=8 beams of
                # 4 requests at max_num_seqs=4). Unverified on a GPU: a guard, not a tuning.
                # Fewer rows than one request's beams: one pass per beam (rows = requests).
                group_size = min(group_size, self.max_batch_size // b)
        forward: _BatchedBeamPasses | _SequentialBeamPasses | _SingleBeamPasses
        if (b == 1 and mapping is None and self.tree_state is None and self.batched_beams
                and self.reuse_kv_prefix):
            forward = _SingleBeamPasses(self, cad, sample_positions, base_seq_lens, warp)
        elif group_size >= 1:
            forward = _BatchedBeamPasses(
                self, cad, sample_positions, base_seq_lens, k, b, slots, group_size, warp,
                row_depth=row_depth,
            )
        else:
            forward = _SequentialBeamPasses(self, cad, sample_positions, base_seq_lens, k, warp)
        row_width = None
        if self.greedy_chain and b > 1 and bool(greedy.any()):
            row_width = torch.where(greedy, 1, b).to(logits.device)
        draft_tokens, q, final = beam_search_batched(
            warp(logits), k, b, forward, greedy, generators, row_width=row_width,
            row_depth=row_depth,
        )
        if self.tree_state is not None:
            return self._tree_round(start, final, mapping, forward, b, k)
        if mapping is not None:
            draft_tokens = mapping.map_draft_to_target_ids(draft_tokens)
        # Past a request's depth q is 0; the runner reads only [row, :num_draft].
        self._last_draft_probs = q.to(torch.float32).contiguous()
        lengths = [k] * num_reqs if row_depth is None else row_depth.tolist()
        self.stats.record(
            num_reqs, k, b, start.first_tokens, forward.tokens, forward.passes,
            request_passes=num_reqs + forward.request_passes,
            sequential=isinstance(forward, _SequentialBeamPasses) and k > 1,
            drafted=sum(lengths),
        )
        if plan is not None and self._cost_control is not None:
            self._cost_control.end(start.req_ids, lengths, forward.passes, forward.tokens)
            # Fewer than vLLM's K, or ragged: the V1 runner takes ragged lists (as
            # adaptive's), V2 its take_draft_lengths.
            return [row[:n] for row, n in zip(draft_tokens.tolist(), lengths)]
        return draft_tokens

    def _tree_round(self, start: RoundStart, final: BeamSearchState, mapping: Any,
                    forward: Any, b: int, k: int) -> list[list[int]]:
        """Draft trees (``draft_tree``): every live beam of the final search state is one
        root-to-leaf path of the request's tree (shared prefixes merged, the best
        ``max_nodes`` nodes by joint draft probability kept, BFS order); the runner
        verifies all of them in one target pass (glue/tree_step.py). Returns each
        request's BFS tokens (ragged) and leaves each node's q for the sampler."""
        from vllm_specx.algorithms.draft_tree import tree_from_beams
        from vllm_specx.methods import tree_max_nodes

        num_reqs = start.num_reqs
        live = torch.isfinite(final.scores)  # [R, B]
        logq = final.token_logprobs.masked_fill(~live.unsqueeze(2), float("-inf"))
        cum = torch.cumsum(logq, dim=2)
        cols = torch.arange(final.width, device=final.tokens.device).expand(num_reqs, -1)
        tree = tree_from_beams(
            [final.tokens[:, :, d] for d in range(k)], [cols] * k,
            [cum[:, :, d] for d in range(k)],
            max_nodes=int(tree_max_nodes(self.settings) or b * k),
            token_logprobs=[logq[:, :, d] for d in range(k)],
        )
        tokens = tree.token_ids
        if mapping is not None:
            tokens = torch.where(tokens >= 0, mapping.map_draft_to_target_ids(
                tokens.clamp(min=0)), tokens)
        width = int(self.num_speculative_tokens)
        q = torch.zeros(num_reqs, width, dtype=torch.float32, device=tokens.device)
        n_nodes = tree.num_nodes.tolist()
        out: list[list[int]] = []
        tok_rows, par_rows = [], []
        assert tree.token_logprobs is not None
        runner = self.model_runner
        # The round's request ids (V1 and V2 rounds carry them) and the live requests: V1's
        # runner.requests, V2's request states.
        req_ids = list(start.req_ids if start.req_ids is not None
                       else runner.input_batch.req_ids[:num_reqs])
        # Cost control (a tree with cost_control: draft_round sets it for the round)
        # keeps per request the nodes that pay (glue/tree_cost.py).
        control = getattr(self, "_round_tree_cost", None)
        kept = [torch.arange(int(n)) for n in n_nodes]
        if control is not None:
            keep = control.prune(req_ids, [tree.parents[r, : n_nodes[r]] for r in range(num_reqs)],
                                 [tree.scores[r, : n_nodes[r]] for r in range(num_reqs)],
                                 forward.passes, forward.tokens,
                                 retired=retired_requests(self))
            kept = [torch.as_tensor(np.flatnonzero(m), dtype=torch.int64) for m in keep]
        for r in range(num_reqs):
            n = int(n_nodes[r])
            tok, par, idx = apply_keep(tokens[r, :n], tree.parents[r, :n].to("cpu"),
                                       np.isin(np.arange(n), kept[r].numpy()))
            q[r, : idx.numel()] = tree.token_logprobs[r, idx.to(q.device)].exp()
            tok_rows.append(tok)
            par_rows.append(par)
            out.append(tok.tolist())
        if control is not None:
            control.end(forward.passes, forward.tokens)
        self._last_draft_probs = q
        live = getattr(runner, "requests", None)
        if live is None:
            live = runner.req_states.req_id_to_index
        self.tree_state.record_round(req_ids, tok_rows, par_rows, live_req_ids=live)
        self.stats.record(
            num_reqs, k, b, start.first_tokens, forward.tokens, forward.passes,
            request_passes=num_reqs + forward.request_passes,
            sequential=isinstance(forward, _SequentialBeamPasses) and k > 1,
        )
        self.stats.tree_nodes += sum(len(t) for t in out)
        return out

    def _beam_slots(self) -> BeamKVSlots | None:
        """The beams' KV slots (built once the KV cache exists), or None without a
        scratch region (then the reason is logged once)."""
        if self._slots is None:
            self._slots = BeamKVSlots(self)
            if not self._slots.usable and self.num_beams > 1:
                logger.warning(
                    "vllm-specx MTAD: one pass per beam (no per-beam KV slots: %s)",
                    self._slots.reason,
                )
        return self._slots if self._slots.usable else None

    def specx_stats(self) -> dict[str, Any]:
        """The drafter's own counters for ``vllm-specx bench`` (``DrafterStats`` keys), and
        the depth control's (chain) or the tree control's (``draft_tree``) model and plans
        when it ran."""
        return tree_cost_stats(self, cost_control_stats(self, self.stats.as_dict()))

    # ----------------------------------------------------------------------------------
    # draft trees under cost control (glue/tree_cost.py): mtad's beams, adaptive's top-k
    # ----------------------------------------------------------------------------------

    # The tree cost control while a round's tree is pruned (read by _tree_round), else None.
    _round_tree_cost: Any = None
    # The drafter's tree cost control (glue/tree_cost.tree_cost_control_for), made once.
    _tree_cost: Any = None

    def draft_round(  # type: ignore[override]
        self, start: RoundStart, sampling: Any
    ) -> torch.Tensor | list[list[int]]:
        """The round after the first pass: the beam search (:meth:`_beam_round`), and with
        a tree and cost control the tree's depth (chosen before the first pass, or here
        where the first pass ran unplanned) and its pruning to the nodes that pay."""
        if self.tree_state is None:
            return self._beam_round(start, sampling)
        control = self._tree_control(start.req_ids or ())
        plan = start.plan if isinstance(start.plan, TreeRoundPlan) else None
        if plan is not None and plan.skip_first_pass:
            # Depth 0 and the first pass ran (a drafter told not to skip it): the plan
            # already ended and recorded the round.
            return [[] for _ in range(start.num_reqs)]
        if control is not None:
            if start.k == 0:
                control.forget_interval()
            elif plan is None:
                control.begin(start.req_ids, start.num_rejected, start.target_tokens)
        sampled = self.may_draft_sampled_children() and wants_sampled_tree(
            self, sampling, start.num_reqs)
        # The round's depth: chosen before the first pass, or here. A tree of i.i.d.
        # children (sampled) is drafted to it and verified whole (keeping a node's
        # children or not by what they drew would bias the sampled rule); a tree of
        # beams (top-k) is drafted to it and pruned. Depth 0: a plain step.
        depth = plan.depth if plan is not None else None
        if control is not None and start.k > 0 and depth is None:
            req_ids = list(start.req_ids or ())
            depth = self._round_depth(control, req_ids, start.k, sampled,
                                      before_first_pass=False)
            if depth == 0:
                self._plain_round(control, req_ids)
                return [[] for _ in range(start.num_reqs)]
        if sampled:
            return sampled_tree_round(self, start, sampling, depth=depth, control=control)
        self._round_tree_cost = control if start.k > 0 else None
        # The beams run to the chosen depth (the beam round reads its plan as per-request
        # depths: every request this one) and the tree is pruned after; without a
        # control, to the configured depth.
        plan_depths = None
        if control is not None and depth is not None:
            plan_depths = RoundPlan(AlwaysContinue(max(int(depth), 1)),
                                    torch.full((start.num_reqs,), int(depth),
                                               dtype=torch.int64), 0.0)
        try:
            return self._beam_round(replace(start, plan=plan_depths), sampling)
        finally:
            self._round_tree_cost = None

    def _plan_tree_before_first_pass(
        self, k: int, req_ids: tuple[str, ...], num_rejected: torch.Tensor | None,
        target_tokens: int,
    ) -> TreeRoundPlan | None:
        """With cost control, a tree round's depth before the first pass: the beams (or
        i.i.d. children) are drafted to it, from what earlier rounds kept (or accepted)
        per depth, as the EAGLE trees do. Depth 0 (:class:`TreeRoundPlan` with
        ``skip_first_pass``) is a plain step whose first pass is skipped; its price
        includes what that leaves to a later catch-up. None (``cost_control`` off, or
        the batch's greedy-ness unknown): the round plans after the first pass."""
        control = self._tree_control(req_ids)
        if control is None or k <= 0:
            return None
        sampled = self._round_is_sampled(req_ids)
        if sampled is None:
            return None
        control.begin(req_ids, num_rejected, target_tokens)
        depth = self._round_depth(control, req_ids, k, sampled, before_first_pass=True)
        if depth > 0:
            return TreeRoundPlan(depth, skip_first_pass=False)
        self._plain_round(control, req_ids)
        return TreeRoundPlan(0, skip_first_pass=True)

    def _tree_control(self, req_ids: Sequence[str]) -> TreeCostControl | None:
        """The tree control for this batch's round, or None: off, or a batch it does not
        weigh (:meth:`controls_batch`), whose whole beam tree is drafted and verified; the
        control's next interval then does not span this step."""
        control = tree_cost_control_for(self)
        if control is not None and not self.controls_batch(req_ids):
            control.forget_interval()
            return None
        return control

    def _round_depth(self, control: TreeCostControl, req_ids: Sequence[str], k: int,
                     sampled: bool, before_first_pass: bool) -> int:
        """The round's depth from the tree control, over the requests that may draft:
        i.i.d. children's from the whole rounds' accepted paths (up to the depths their
        node budget allows), the beams' from the pruned trees (up to the beams' depth,
        the specx K: vLLM's K is the node budget)."""
        return control.choose_depth(
            requests_that_may_draft(self, req_ids),
            sampled_tree_depths(self.settings, k) if sampled
            else int(self.settings["num_speculative_tokens"]),
            skips_first_pass=before_first_pass, whole=sampled)

    def _plain_round(self, control: TreeCostControl, req_ids: Sequence[str]) -> None:
        """A round of depth 0: it ends here, and every request's tree is empty."""
        control.skipped(req_ids)
        empty = [torch.empty(0, dtype=torch.int64) for _ in req_ids]
        self.tree_state.record_round(list(req_ids), empty, empty)

    def may_draft_sampled_children(self) -> bool:
        """Whether a batch with a sampled request may draft i.i.d. children instead of the
        beams (:class:`DraftTreeRound`); an mtad tree is its beams, never such children."""
        return False

    def _round_is_sampled(self, req_ids: Sequence[str]) -> bool | None:
        """Before the first pass: whether this round will draft i.i.d. children
        (``sampled_children_on``, a sampler that reads their q rows, a sampled request in
        the batch); None where the runner does not say which requests are greedy."""
        if not (self.may_draft_sampled_children() and sampled_children_on(self)):
            return False
        all_greedy = self._all_greedy(req_ids)
        return None if all_greedy is None else not all_greedy


class MTADProposer(MTADRound, SpecxDraftModelProposer):
    """Draft-model proposer that drafts by beam search (MTAD). See the module docstring."""

    # A step whose cost control plans depth 0 skips the first pass (glue/draft_passes.py):
    # a draft model's first pass reads only token ids, so DraftKVHoles can catch it up.
    skips_idle_first_pass = True


class DraftTreeRound(MTADRound):
    """``adaptive`` with ``draft_tree``: a dynamic tree from the draft model, drafted by the
    MTAD round's batched beam passes (width ``branching``, depth ``max_depth``: the best
    ``branching`` continuations of the best paths per depth, deterministic for greedy
    requests, drawn without the verifier's randomness otherwise) and kept to ``max_nodes``
    nodes by joint draft probability. The runner hook hands it settings in MTAD's terms
    (:func:`tree_drafter_settings`); the sampler verifies with the lossless
    ``"deterministic"`` tree rule, which needs no draft probabilities. One round for both
    runners: :class:`DraftTreeProposer` (V1) and ``glue/v2_speculators.py``'s
    ``DraftTreeV2Speculator`` (Model Runner V2).

    * With ``cost_control`` (its default) the round's depth is chosen before the first
      pass (depth 0: a plain step that skips that pass, its draft KV caught up later),
      and the top-k tree drafted to it is pruned per request to the nodes that pay at the
      engine's measured costs, down to none (``glue/tree_cost.py``).
    * A batch with a sampled request drafts i.i.d. children instead
      (``"sampled_children"``, on by default; ``glue/sampled_tree_round.py``), verified by
      the ``"sampled"`` rule with the q rows the draws came from. Those trees are not
      pruned (the rule is lossless only where keeping a node's children does not depend
      on what they drew): with ``cost_control`` their depth is chosen before drafting,
      0 included, and they are verified whole."""

    # The last sampled-children round's [R, N, V] q rows (None after a top-k round).
    _sampled_q: torch.Tensor | None = None
    sampled_tree_rounds: int = 0
    # With cost control the round's depth is chosen before the first pass, and a round of
    # depth 0 skips that pass (DraftKVHoles catches the draft KV up before the next first
    # pass that runs), as the chain's all-zero steps do (V1 SpecxPasses.propose; V2
    # SpecxV2DraftSpeculator.propose plans there with plans_before_first_pass).
    skips_idle_first_pass = True
    plans_before_first_pass = True

    def may_draft_sampled_children(self) -> bool:
        """Whether the runner's sampler reads the q rows of i.i.d. children (V1's specx
        sampler always does; on V2 only the specx sampler, which a tree config installs)."""
        return True

    def draft_round(  # type: ignore[override]
        self, start: RoundStart, sampling: Any
    ) -> torch.Tensor | list[list[int]]:
        self._sampled_q = None
        return super().draft_round(start, sampling)

    def take_last_draft_probs(self) -> torch.Tensor | None:
        # A top-k round hands no q: a tree verified as a chain (a step that falls back to
        # chains) then takes the one-hot rule, lossless for drafts chosen without the
        # verifier's randomness; the MTAD nodes' q would make the standard rule treat BFS
        # siblings as one chain drawn from q, which they are not. A sampled-children
        # round hands each node's q row (siblings share their parent's), which tells the
        # specx sampler to use the "sampled" rule.
        self._last_draft_probs = None
        q, self._sampled_q = self._sampled_q, None
        return q


class DraftTreeProposer(DraftTreeRound, SpecxDraftModelProposer):
    """``adaptive`` with ``draft_tree`` on vLLM's V1 runner (:class:`DraftTreeRound`)."""


def tree_drafter_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A draft-model tree's shape as the MTAD round's knobs (beams = branching, K = depth;
    greedy requests draft the tree too)."""
    shape = draft_model_tree(settings)
    assert shape is not None
    return {**settings, "num_beams": shape["branching"],
            "num_speculative_tokens": shape["max_depth"], "greedy_drafting": "beam"}


class _BatchedBeamPasses:
    """The beam search's model callback: depth j is one draft pass over every live beam
    of every request, each beam in its own KV slot (see the module docstring).

    Host-side bookkeeping on small [R, B] tensors: which slot each beam occupies and what
    each slot holds, so a beam only feeds what its slot does not hold yet.
    """

    def __init__(
        self,
        proposer: MTADRound,
        cad: CommonAttentionMetadata,
        sample_positions: torch.Tensor,
        base_seq_lens: torch.Tensor,
        k: int,
        num_beams: int,
        slots: BeamKVSlots | None,
        group_size: int,
        warp: Callable[[torch.Tensor], torch.Tensor],
        row_depth: torch.Tensor | None = None,
    ) -> None:
        self.p = proposer
        self.lookahead = proposer.lookahead_passes(cad, sample_positions, base_seq_lens)
        self.cad = cad
        self.sample_positions = sample_positions
        self.k = k
        self.num_beams = num_beams
        self.slots = slots
        self.warp = warp
        n = cad.batch_size()
        self.num_reqs = n
        self.groups = [(lo, min(lo + group_size, n)) for lo in range(0, n, group_size)]
        # Requests that run lookahead passes (cost control's depths: deeper than 1); only
        # they need their partial block copied into their beams' scratch slots.
        self.copy_rows = None if row_depth is None else row_depth.to("cpu") > 1
        self.tables: torch.Tensor | None = None
        if len(self.groups) == 1 and num_beams > 1 and k > 1 and slots is not None:
            # All beams fit: one copy-on-write for the round, slots hold their tails
            # from depth to depth.
            self.tables = slots.beam_block_tables(
                cad.block_table_tensor[:n], sample_positions, num_beams, k,
                copy_rows=self.copy_rows,
            )
        self.held = torch.zeros(n, num_beams, max(k - 1, 1), dtype=torch.int64)
        self.held_len = torch.zeros(n, num_beams, dtype=torch.int64)
        self.slot_of = torch.zeros(n, 1, dtype=torch.int64)  # the empty beam: slot 0
        self.max_tokens = proposer.max_num_tokens
        self.tokens = self.passes = self.request_passes = 0

    def __call__(self, state: BeamSearchState) -> BeamLogprobs:
        n, b = self.num_reqs, self.num_beams
        tails = state.tokens.to("cpu", torch.int64)  # [R, B, j]
        j = tails.shape[2]
        slot = assign_beam_slots(state.parents[-1].to("cpu"), self.slot_of)
        self.slot_of = slot
        live = torch.isfinite(state.scores).to("cpu")
        slot_idx = slot.unsqueeze(2).expand(-1, -1, self.held.shape[2])
        held = self.held.gather(1, slot_idx)
        held_len = self.held_len.gather(1, slot)
        start = tail_feed_start(
            held.reshape(n * b, -1), held_len.reshape(-1), tails.reshape(n * b, j),
            reuse=self.p.reuse_kv_prefix,
        ).view(n, b)
        if len(self.groups) > 1:
            # Groups share the scratch region: a scratch slot holds nothing of its own
            # beam any more when its group runs again.
            start = torch.where(slot > 0, torch.zeros_like(start), start)
        index = torch.full((n, b), -1, dtype=torch.int64)
        hidden_parts: list[torch.Tensor] = []
        count = 0
        for lo, hi in self.groups:
            sel = live[lo:hi].nonzero()  # [m, 2] (request - lo, beam), row-major
            if sel.numel() == 0:
                continue  # nothing of this group to feed (past their depths): no copies
            tables = self.tables
            if tables is None and b > 1 and self.slots is not None:
                tables = self.slots.beam_block_tables(
                    self.cad.block_table_tensor[lo:hi], self.sample_positions[lo:hi], b,
                    self.k, copy_rows=live[lo:hi].any(dim=1),
                )
                offset = lo
            else:
                offset = 0
            req = sel[:, 0] + lo
            beam = sel[:, 1]
            beam_slot = slot[req, beam]
            feed_start = start[req, beam]
            rows_tails = tails[req, beam]
            if tables is not None:
                dev = tables.device
                block_table = tables[(req - offset).to(dev), beam_slot.to(dev)]
            else:
                block_table = None
            q_lens = j - feed_start
            for a, c in split_rows_by_token_budget(q_lens, self.max_tokens):
                hidden = self.lookahead.run(
                    req[a:c], rows_tails[a:c], feed_start[a:c],
                    block_table=None if block_table is None else block_table[a:c],
                )
                hidden_parts.append(hidden)
                index[req[a:c], beam[a:c]] = torch.arange(count, count + (c - a))
                count += c - a
                self.passes += 1
                self.request_passes += int(torch.unique(req[a:c]).numel())
            self.tokens += int(q_lens.sum())
            # What each fed slot holds now.
            self.held[req, beam_slot, :j] = rows_tails
            self.held_len[req, beam_slot] = j
        hidden_all = torch.cat(hidden_parts, 0) if hidden_parts else None
        model = self.p.model
        warp = self.warp

        def beam_logprobs(beam: torch.Tensor) -> torch.Tensor:
            idx = index.gather(1, beam.to("cpu").view(-1, 1)).squeeze(1)
            fed = idx >= 0
            if hidden_all is None:
                raise RuntimeError("MTAD: no live beam was fed at this depth")
            dev = hidden_all.device
            if bool(fed.all()):
                return warp(model.compute_logits(hidden_all[idx.to(dev)]))
            # Dead beams' rows (and requests past their depth): zeros, any finite values
            # (their -inf scores keep them out), and no LM-head rows spent on them.
            rows = fed.nonzero().squeeze(1)
            # No fed row at all for this beam index: one LM-head row for the vocabulary's
            # width, none of it kept.
            some = model.compute_logits(hidden_all[idx[rows].to(dev)] if rows.numel()
                                        else hidden_all[:1])
            return warp(_into_rows(some[: rows.numel()], rows, idx.shape[0]))

        return beam_logprobs


def _into_rows(values: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows, V]``: ``values`` at ``rows``, zeros elsewhere. The rows left at zero
    are beams that were not fed (dead, or their request is past its depth): any finite
    values do, their -inf scores keep them out of the search, and no LM-head row is spent
    on them."""
    out = values.new_zeros(num_rows, values.shape[1])
    out[rows.to(out.device)] = values
    return out


class _SingleBeamPasses:
    """The beam search's model callback at ``num_beams`` 1: each request's one beam
    extends its own tail in the request's own lookahead slots, so depth j is one pass
    feeding every request its newest token at ``P + j`` -- the pass
    :class:`_BatchedBeamPasses` runs at B = 1, without its slot bookkeeping (which beam
    holds which slot, what each slot holds, a few host reads per depth), and fed from the
    device. The same forward inputs, so the same log-probs and drafts."""

    def __init__(
        self,
        proposer: MTADRound,
        cad: CommonAttentionMetadata,
        sample_positions: torch.Tensor,
        base_seq_lens: torch.Tensor,
        warp: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.p = proposer
        self.lookahead = proposer.lookahead_passes(cad, sample_positions, base_seq_lens)
        self.num_reqs = cad.batch_size()
        self.rows = torch.arange(self.num_reqs)
        self.warp = warp
        self.tokens = self.passes = self.request_passes = 0

    def __call__(self, state: BeamSearchState) -> BeamLogprobs:
        tails = state.tokens[:, 0, :]  # [R, j]: each request's one beam
        j = tails.shape[1]
        # Requests past their own depth (cost control's row_depth) have no live beam and
        # leave the pass.
        live = torch.isfinite(state.scores[:, 0]).to("cpu")
        every = bool(live.all())
        rows = self.rows if every else self.rows[live]
        n = int(rows.numel())
        start = torch.full((n,), j - 1, dtype=torch.int64)
        hidden = self.lookahead.run(rows, tails if every else tails[live.to(tails.device)],
                                    start)
        self.tokens += n
        self.passes += 1
        self.request_passes += n
        logits = self.p.model.compute_logits(hidden)
        if not every:
            logits = _into_rows(logits, rows, self.num_reqs)
        logprobs = self.warp(logits)
        return lambda beam: logprobs


class _SequentialBeamPasses:
    """The beam search's model callback without per-beam KV slots: every beam's tail is
    rebuilt in the request's own lookahead slots, one pass per beam (lazily, when the
    search asks for that beam's log-probs: siblings come back to back, see
    ``beam_search_batched``)."""

    def __init__(
        self,
        proposer: MTADRound,
        cad: CommonAttentionMetadata,
        sample_positions: torch.Tensor,
        base_seq_lens: torch.Tensor,
        k: int,
        warp: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.tail = _TailWriter(proposer, cad, sample_positions, base_seq_lens, k)
        self.warp = warp
        self.num_reqs = cad.batch_size()
        self.tokens = self.passes = self.request_passes = 0

    def __call__(self, state: BeamSearchState) -> BeamLogprobs:
        tails = state.tokens.to("cpu")  # [R, B, j]
        j = tails.shape[2]
        # Requests past their own depth (cost control's row_depth): no live beam, no pass.
        active = torch.isfinite(state.scores).any(dim=1).to("cpu")
        rows = None if bool(active.all()) else active.nonzero().squeeze(1)

        def beam_logprobs(beam: torch.Tensor) -> torch.Tensor:
            pick = beam.to("cpu").view(-1, 1, 1).expand(-1, 1, j)
            beam_tails = tails.gather(1, pick).squeeze(1)
            if rows is not None:
                beam_tails = beam_tails[rows]
            logits, n_tok, n_pass = self.tail.run(beam_tails, rows)
            self.tokens += n_tok
            self.passes += n_pass
            self.request_passes += self.num_reqs if rows is None else int(rows.numel())
            if rows is not None:
                logits = _into_rows(logits, rows, self.num_reqs)
            return self.warp(logits)

        return beam_logprobs


class _TailWriter:
    """Runs "beam tail" passes for one drafting round and remembers what the lookahead
    slots of every request hold, so a pass only recomputes what is not there yet.

    The passes themselves are :class:`~vllm_specx.glue.draft_passes.LookaheadPasses`
    (shared with the adaptive drafter); what to feed is planned by
    :mod:`vllm_specx.algorithms.beam_tails`. Host-side bookkeeping: the tails are small
    ([R, j] ints), and every pass needs its token count on the host anyway.
    """

    def __init__(
        self,
        proposer: MTADRound,
        cad: CommonAttentionMetadata,
        sample_positions: torch.Tensor,
        base_seq_lens: torch.Tensor,
        k: int,
    ) -> None:
        self.p = proposer
        self.lookahead = proposer.lookahead_passes(cad, sample_positions, base_seq_lens)
        self.num_reqs = cad.batch_size()
        # Tokens whose KV sits in the lookahead slots P+1.. (valid for the first
        # `held_len` of them); nothing is held at the start of a round.
        self.held = torch.zeros(self.num_reqs, max(k - 1, 1), dtype=torch.int64)
        self.held_len = torch.zeros(self.num_reqs, dtype=torch.int64)
        # Rows per pass: every pass must fit the proposer's token buffers.
        self.max_tokens = proposer.max_num_tokens

    def run(self, tails: torch.Tensor, rows: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, int, int]:
        """Make ``tails[i]`` ([n, j]) the content of request ``rows[i]``'s lookahead slots
        (``rows`` None: every request, in order) and return the draft logits after its
        last token ([n, V]), tokens fed, passes run."""
        tails_cpu = tails.to("cpu", torch.int64)
        j = tails_cpu.shape[1]
        req = torch.arange(self.num_reqs, dtype=torch.int64) if rows is None else rows.to(
            "cpu", torch.int64)
        start = tail_feed_start(self.held[req], self.held_len[req], tails_cpu,
                                reuse=self.p.reuse_kv_prefix)
        q_lens = j - start
        logits_parts = []
        for lo, hi in split_rows_by_token_budget(q_lens, self.max_tokens):
            hidden = self.lookahead.run(req[lo:hi], tails_cpu[lo:hi], start[lo:hi])
            logits_parts.append(self.p.model.compute_logits(hidden))
        tokens, passes = int(q_lens.sum()), len(logits_parts)
        self.held[req, :j] = tails_cpu
        self.held_len[req] = j
        return torch.cat(logits_parts, dim=0), tokens, passes
