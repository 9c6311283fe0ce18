"""One chain-draft round with a per-request stop and a shrinking batch, for every chain
drafter (vLLM glue, checked on vLLM 0.32 V1).

:class:`ChainDrafter` is the round the ``adaptive`` drafter (a draft model,
``glue/adaptive_proposer.py``) and the ``specx_mtp`` drafter (the target's MTP layer,
``glue/mtp_proposer.py``) share; each is this round plus the few hooks where they differ,
the way vLLM's ``draft_model.py`` and ``eagle.py`` are a few overrides over one base:

* the round's **first pass** (``SpecxPasses.propose``) gives ``q_1``; every request
  draws ``Y_1``;
* at depth ``j`` (0..K_max-2) each live request holds ``Y_1..Y_{j+1}`` (the last one just
  drawn) and the stop rule (``algorithms/draft_stop.py``) says whether it goes on. Those
  that go on feed ``Y_{j+1}`` to the draft in one pass over the requests STILL DRAFTING
  only (:class:`~.draft_passes.LookaheadPasses`; no forward work for a request that
  stopped), which gives the hidden state the acceptance head reads and ``q_{j+2}``, from
  which ``Y_{j+2}`` is drawn.

A stop keeps the token already drawn: it cost its draft forward already and may be
accepted, so a request that drafts ``n`` tokens costs exactly ``n`` draft forwards (the
first pass and ``n - 1`` lookahead passes), like a fixed-length draft of ``n``.

The round returns ``list[list[int]]`` (one list per request, of the length it drafted),
the ragged form vLLM's ngram proposer returns, so the scheduler receives exactly the
drafted tokens and verification costs exactly the drafted positions (EMS-SD: nothing is
padded to the longest draft; the method's spec turns async scheduling off).

Hooks (override in a drafter; the defaults are the draft-model drafter's):

* :meth:`ChainDrafter.read_pass` -- which part of a pass's output the LM head reads and
  which the acceptance head reads;
* :meth:`ChainDrafter.drafts_argmax` -- every request drafts the argmax (one-hot ``q``:
  no draft probabilities are kept for the sampler), or sampled requests draw from ``q``;
* :meth:`ChainDrafter.feed_hidden` with :attr:`ChainDrafter.feeds_hidden` -- what, besides
  the token, the next pass reads (MTP: each live request's hidden state of the step
  before);
* :meth:`ChainDrafter.stop_rule` -- the round's stop rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_specx.algorithms.beam_draft import greedy_mask_from_temperature
from vllm_specx.algorithms.draft_length import CostStop
from vllm_specx.algorithms.draft_sampling import draw_draft_tokens
from vllm_specx.algorithms.draft_stop import DraftStopRule, fixed_keep, step_needed
from vllm_specx.glue.cost_model import CostControl, cost_control_for, cost_control_stats
from vllm_specx.glue.draft_passes import (
    RoundStart,
    SpecxPasses,
    load_acceptance_head,
    round_stop_rule,
)


@dataclass
class ChainDraftStats:
    """What a chain drafter did, for ``vllm-specx bench`` (``specx_stats()``).

    ``draft_tokens``: tokens drafted (what the scheduler receives). ``lookahead_rows``:
    request-rows fed to the lookahead passes (with a padded batch it would be
    ``requests * (K_max - 1)``). ``length_histogram[n]``: requests that drafted n tokens.
    """

    rounds: int = 0
    requests: int = 0
    draft_tokens: int = 0
    first_pass_tokens: int = 0
    lookahead_passes: int = 0
    lookahead_rows: int = 0
    padded_lookahead_rows: int = 0
    length_histogram: dict[int, int] = field(default_factory=dict)

    def record(self, lengths: list[int], k_max: int, first: int, passes: int, rows: int) -> None:
        self.rounds += 1
        self.requests += len(lengths)
        self.draft_tokens += sum(lengths)
        self.first_pass_tokens += first
        self.lookahead_passes += passes
        self.lookahead_rows += rows
        self.padded_lookahead_rows += len(lengths) * max(k_max - 1, 0)
        for n in lengths:
            self.length_histogram[n] = self.length_histogram.get(n, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        # Keys read by the bench (``DrafterStats``): the scheduler receives exactly the
        # drafted tokens, and draft forwards are counted per request (first pass +
        # one lookahead row per step the request was still drafting).
        return {
            "drafted_tokens": self.draft_tokens,
            "scheduled_tokens": self.draft_tokens,
            "draft_forward_passes": self.requests + self.lookahead_rows,
            "rounds": self.rounds,
            "requests": self.requests,
            "batched_forward_passes": self.rounds + self.lookahead_passes,
            "first_pass_tokens": self.first_pass_tokens,
            "lookahead_rows": self.lookahead_rows,
            "padded_lookahead_rows": self.padded_lookahead_rows,
            "length_histogram": {str(k): v for k, v in sorted(self.length_histogram.items())},
        }


class ChainRound:
    """The chain-draft round and its hooks (see the module doc), over no runner: mixed
    into a V1 proposer as :class:`ChainDrafter`, and into a Model Runner V2 speculator
    (``glue/v2_speculators.py``), which supplies ``model``, ``settings``,
    ``lookahead_passes`` and the round's :class:`~.draft_passes.RoundStart`."""

    settings: dict[str, Any]
    model: Any
    _last_draft_probs: torch.Tensor | None
    # True: the next pass also reads each live request's hidden state of the step before
    # (handed over by :meth:`feed_hidden`).
    feeds_hidden: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stats = ChainDraftStats()
        self.head: torch.nn.Module | None = None
        # V1 proposers get the runner as their third argument and keep nothing of it; cost
        # control reads the batch's request ids off it (a V2 speculator sets its own).
        if getattr(self, "runner", None) is None:
            self.runner = args[2] if len(args) > 2 else kwargs.get("runner")
        self._cost_control: CostControl | None = None

    # -- set-up -----------------------------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        # The first floating-point parameter: an EAGLE-3 head's first is its int64 d2t map.
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        self.head = load_acceptance_head(self.settings, self.device, dtype)

    def specx_stats(self) -> dict[str, Any]:
        return cost_control_stats(self, self.stats.as_dict())

    # -- hooks ------------------------------------------------------------------------

    def stop_rule(self, k_max: int) -> DraftStopRule:
        """The round's rule (``k_max``: what the runner asks for this step)."""
        return round_stop_rule(self.settings, k_max, self.head)

    def cost_control(self, k_max: int) -> CostControl | None:
        """The drafter's cost control (``glue/cost_model.py``), or None when the
        ``cost_control`` setting is off (then the stop rule alone decides)."""
        return cost_control_for(self, k_max)

    def plan_before_first_pass(
        self, k: int, req_ids: tuple[str, ...], num_rejected: torch.Tensor | None,
        target_tokens: int,
    ) -> Any:
        """The cost control's plan, made before the first pass (V1 drafters that skip an
        idle first pass, ``skips_idle_first_pass``): the step's cost then splits into the
        target side and a round that includes the first pass, so the control weighs the
        first pass against what drafting brings. All zero: the step is a plain decode
        step (``skip_first_pass``: the caller skips the first pass)."""
        control = self.cost_control(k)
        if control is None:
            return None
        control.begin(req_ids, num_rejected, target_tokens)
        plan = control.plan(req_ids, k, self.stop_rule(k), self.device)
        if not bool(plan.caps.any()):
            plan.skip_first_pass = True
            self.stats.record([0] * len(req_ids), k, 0, 0, 0)
            control.end(req_ids, [0] * len(req_ids), 0, 0)
        return plan

    def read_pass(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the LM head reads, what the acceptance head reads) of a pass's output
        rows. A draft model's final hidden state (after its final norm) is both."""
        return out, out

    def drafts_argmax(self) -> bool:
        """True: every request drafts the argmax (one-hot ``q``, nothing kept for the
        sampler); False: sampled requests draw from the warped ``q`` and keep it."""
        return self.settings.get("draft_sampling") == "greedy"

    def feed_hidden(self, hidden: torch.Tensor) -> None:
        """Put the live requests' hidden states of the step before (``[n, H]``, in the
        order of the next pass's rows) where the next pass reads them. Called only when
        :attr:`feeds_hidden` is True."""
        raise NotImplementedError(f"{type(self).__name__} sets feeds_hidden but has no feed_hidden")

    # -- the round ----------------------------------------------------------------------

    def draft_round(
        self, start: RoundStart, sampling_metadata: SamplingMetadata
    ) -> list[list[int]] | torch.Tensor:
        k_max, num_reqs = start.k, start.num_reqs
        if k_max == 0:
            if self._cost_control is not None:
                # A step without a round: the next interval would span two steps.
                self._cost_control.costs.forget_interval()
            # Same contract as vLLM's proposers: the pass above keeps the draft KV in sync.
            return start.no_drafts()

        device = start.out.device
        control = self.cost_control(k_max)
        req_ids = start.req_ids
        if control is not None:
            if start.plan is None:
                control.begin(req_ids, start.num_rejected, start.target_tokens)
            if req_ids is None:
                req_ids = tuple(str(r) for r in range(num_reqs))
        lm_in, head_in = self.read_pass(start.out)
        argmax_only = self.drafts_argmax()
        if argmax_only:
            # Every request drafts the argmax: no q is kept, no temperature is read.
            keep_q = False
            draw_greedy = torch.ones(num_reqs, dtype=torch.bool, device=device)
        else:
            greedy = greedy_mask_from_temperature(sampling_metadata.temperature, num_reqs,
                                                  device)
            # Sampled requests need their full q for the residual; greedy ones never read
            # it. vLLM's host flag where it has one: no device read for it.
            all_greedy = getattr(sampling_metadata, "all_greedy", None)
            if all_greedy is None:
                all_greedy = bool(greedy.all())
            keep_q = not all_greedy
            draw_greedy = greedy
        generators = sampling_metadata.generators or {}

        rule = self.stop_rule(k_max)
        caps = None
        if control is not None:
            plan = start.plan or control.plan(req_ids, k_max, rule, device)
            rule, caps = plan.rule, plan.caps
        state = rule.start(num_reqs, device)
        # The drafts stay on the device while the round runs and are read once, after it:
        # a pass reads back only what the host must know to build it (which requests are
        # still drafting, when the rule decides that per row). While every request is
        # still drafting (always, for a fixed K) the drafts are kept as one column per
        # depth, stacked once at the end, and the hidden states pass straight to the next
        # pass: no scatter into [R, K] per depth, no gather of the live rows, and the
        # lengths are known on the host (a GPU launches fewer kernels per pass).
        # ``tokens``/``lengths`` ([R, K], [R] on the device) exist only once some request
        # stopped or was planned out (or the sampler keeps q per request).
        cols: list[torch.Tensor] = []
        tokens: torch.Tensor | None = None
        lengths: torch.Tensor | None = None
        q_full = None
        # [R, H]: each request's latest hidden state, for drafters whose next pass reads
        # it, once the rows stop being the whole batch in order.
        hidden_by_req: torch.Tensor | None = None
        live = torch.arange(num_reqs)  # host indices of the requests still drafting
        dev_live: torch.Tensor | None = None  # None: every request, in batch order

        def scatter_from_now(depth: int) -> None:
            # From here on, drafts are written per row: the batch shrinks (or did).
            nonlocal tokens, lengths, hidden_by_req, dev_live
            if tokens is not None:
                return
            dev_live = live.to(device)
            tokens = start.out.new_zeros((num_reqs, k_max), dtype=torch.int64)
            lengths = start.out.new_full((num_reqs,), depth, dtype=torch.int64)
            if cols:
                tokens[:, :depth] = torch.stack(cols, dim=1)
            if self.feeds_hidden:
                hidden_by_req = head_in.clone()

        if keep_q:
            scatter_from_now(0)
        if caps is not None and not bool(caps.all()):
            # Cost control planned zero tokens for some requests: the drafter does no
            # work for them (not even their first token's logits); nobody: no work at all.
            scatter_from_now(0)
            live = live[caps > 0]
            if live.numel() == 0:
                self.stats.record([0] * num_reqs, k_max, start.first_tokens, 0, 0)
                control.end(req_ids, [0] * num_reqs, 0, 0)
                return [[] for _ in range(num_reqs)]
            dev_live = live.to(device)
            lm_in, head_in = lm_in[dev_live], head_in[dev_live]
        # Passes fed one token per row (``run_chain``) where the runner's passes have
        # them (V1); else the general pass over the drafts so far.
        passes = self.lookahead_passes(start.cad, start.sample_positions, start.base_seq_lens)
        run_chain = getattr(passes, "run_chain", None)
        n_passes = n_rows = 0
        depth = 0
        while True:
            # Y_{depth+1} is drawn from q_{depth+1} (the first pass's logits at depth 0,
            # else those after feeding Y_depth) and joins the draft of every live request.
            last = depth + 1 >= k_max
            stepping = not last and step_needed(rule, depth)
            logits = self.model.compute_logits(lm_in)
            y, probs = draw_draft_tokens(
                logits, live, draw_greedy, generators, sampling_metadata.temperature,
                sampling_metadata.top_k, sampling_metadata.top_p,
                need_probs=keep_q or stepping,
            )
            if q_full is None and keep_q:
                q_full = torch.zeros(num_reqs, k_max, probs.shape[-1], dtype=torch.float32,
                                     device=device)
            if tokens is None:
                cols.append(y)
            else:
                tokens[dev_live, depth] = y
                lengths[dev_live] = depth + 1
                if q_full is not None:
                    q_full[dev_live, depth] = probs
            if last:
                break
            # Go on (feed Y_{depth+1}) or stop with depth + 1 tokens, per request.
            keep = None
            if stepping:
                y_prob = probs.gather(1, y.view(-1, 1)).squeeze(1)
                row_state = state if dev_live is None else state[dev_live]
                new_state, keep = rule.step(
                    row_state, depth, next_token_probs=y_prob, next_probs=probs,
                    hidden=head_in if rule.needs_hidden else None,
                )
                if dev_live is None:
                    state = new_state.to(state.dtype)
                else:
                    state[dev_live] = new_state.to(state.dtype)
            fixed = fixed_keep(rule, depth)
            fed = y
            if fixed is None:
                # The one read a pass needs: which requests go on (the host builds the
                # next pass's metadata over them).
                keep_host = keep.to("cpu")
                if not bool(keep_host.all()):
                    scatter_from_now(depth + 1)
                    live = live[keep_host]
                    if live.numel() == 0:
                        break
                    # (index_select at host indices: a device bool mask would sync)
                    fed = y.index_select(0, keep_host.nonzero().squeeze(1).to(device))
                    dev_live = live.to(device)
            elif not fixed:
                break
            depth += 1
            # Feed Y_depth to the requests still drafting (their KV for Y_1..Y_{depth-1}
            # was written by the earlier passes of this round): the batch shrinks.
            if self.feeds_hidden:
                self.feed_hidden(head_in if hidden_by_req is None
                                 else hidden_by_req[dev_live])
            if run_chain is not None:
                out = run_chain(live, dev_live, fed, depth)
            else:
                feed_from = torch.full((live.numel(),), depth - 1, dtype=torch.int64)
                so_far = (torch.stack(cols, dim=1) if tokens is None
                          else tokens[dev_live, :depth])
                out = passes.run(live, so_far, feed_from)
            lm_in, head_in = self.read_pass(out)
            if hidden_by_req is not None:
                hidden_by_req[dev_live] = head_in
            n_passes += 1
            n_rows += live.numel()

        # The round's one read of its drafts (and of their lengths, once the batch shrank).
        if tokens is None:
            tokens_host = torch.stack(cols, dim=1).cpu()
            lengths_host = torch.full((num_reqs,), len(cols), dtype=torch.int64)
        else:
            tokens_host, lengths_host = tokens.cpu(), lengths.cpu()
        if caps is not None:
            lengths_host = torch.minimum(lengths_host, caps)
            # The confidences the cost stop read, for its calibration (after the read
            # above, so no extra wait).
            confidences = (rule.confidences(state).cpu()
                           if isinstance(rule, CostStop) and rule.reads_confidence else None)
            control.end(req_ids, lengths_host.tolist(), n_passes, n_rows, confidences)
        length_list = lengths_host.tolist()
        self.stats.record(length_list, k_max, start.first_tokens, n_passes, n_rows)
        if q_full is not None:
            # The runner slices [row, :num_draft] per request: rows past a request's
            # length are never read.
            self._last_draft_probs = q_full
        return [row[:n] for row, n in zip(tokens_host.tolist(), length_list)]


class ChainDrafter(ChainRound, SpecxPasses):
    """The chain-draft round over a vLLM V1 proposer (see the module doc). A drafter mixes
    it in before its vLLM proposer class and overrides the hooks where it differs."""
