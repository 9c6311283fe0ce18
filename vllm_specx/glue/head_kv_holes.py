"""Skipped first passes of an EAGLE / EAGLE-3 head or an MTP layer, and their catch-up
(issue 32; vLLM glue, checked on vLLM 0.32 V1 and Model Runner V2).

A draft model's first pass at position ``i`` reads only the committed token there, so
:class:`~.draft_passes.DraftKVHoles` catches a skipped pass up from the runner's token ids.
A head's first pass at position ``i`` reads the token at ``i + 1`` and the target's
hidden state at ``i`` (EAGLE: the final one; EAGLE-3: its auxiliary layers combined by the
head's ``fc``; MTP: the final one), which vLLM keeps only for the step that computed it.
:class:`HeadKVHoles` therefore keeps, on a step whose first pass is skipped, exactly what
that pass would have been fed at each accepted position (vLLM's shifted token ids with the
step's new token at the last accepted row, and the hidden-state rows as the runner hands
them over: EAGLE-3's auxiliary layers uncombined, ``3 H`` wide, so a skipped step does not
pay the ``fc``), per request id, and its catch-up feeds them back at those positions in one
pass (EAGLE-3: through the ``fc`` first; no logits), so the head's KV, and every draft
after, is what it would have been without the skip.

Bounds: a request keeps at most :attr:`HeadKVHoles.max_hole` positions; a step that would
take one past it (a long prefill chunk) is not skipped: its first pass runs and first
catches up what is kept. A long run of skipped steps retires the request instead
(``DraftKVHoles.retire_after``): nothing more is kept for it, and it drafts no more. With prefix
caching, blocks vLLM caches are caught up when they complete (as for a draft model), so a
request keeps at most a block plus a step. Entries of requests the runner no longer holds
(finished) are dropped; a request recomputed from before its hole (resumed after
preemption) drops its entry at its next first pass, which rewrites those positions.
Draft trees skip too (a depth-0 round of the tree cost control,
``glue/eagle_tree_proposer.py``): their kept rows are the chain layout the first pass
reads after a tree step. vLLM's drafting paths that reshape the first pass's inputs
(parallel drafting, a heterogeneous vocabulary) never skip.

One record for both runners: V1's ``EagleChainProposer`` keeps a step through
:meth:`HeadKVHoles.keep_first_pass_inputs`, Model Runner V2's heads
(``glue/v2_eagle.py``) through :meth:`HeadKVHoles.keep_rows` with the rows read off V2's
batch; the catch-up passes are each runner's lookahead passes.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_specx.glue.draft_passes import DraftKVHoles


@dataclass
class _Kept:
    """A request's first-pass inputs at positions ``pos0 .. end - 1``: one part per
    skipped step (views of that step's gathered rows, so keeping costs no work per
    request), joined only when a catch-up reads them."""

    pos0: int
    tokens: list[torch.Tensor]  # [n_i] int64: the token fed at each position (the next one)
    hidden: list[torch.Tensor]  # [n_i, H]: the hidden state fed at each position
    n: int = 0

    @property
    def end(self) -> int:
        return self.pos0 + self.n

    def append(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        self.tokens.append(tokens)
        self.hidden.append(hidden)
        self.n += int(tokens.shape[0])

    def rows(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens and hidden states fed at positions ``a .. b - 1``."""
        if len(self.tokens) > 1:
            self.tokens, self.hidden = [torch.cat(self.tokens)], [torch.cat(self.hidden)]
        i, j = a - self.pos0, b - self.pos0
        return self.tokens[0][i:j], self.hidden[0][i:j]

    def drop_before(self, pos: int) -> None:
        cut = min(max(pos - self.pos0, 0), self.n)
        if cut:
            tokens, hidden = self.rows(self.pos0, self.end)
            self.tokens, self.hidden = [tokens[cut:]], [hidden[cut:]]
            self.pos0 += cut
            self.n -= cut


class HeadKVHoles(DraftKVHoles):
    """:class:`DraftKVHoles` for a head that reads the target's hidden states (see the
    module doc): the hole record plus each hole's first-pass inputs."""

    # Most positions one request's hole may span (what is kept is [max_hole, H] at most).
    max_hole = 64

    def __init__(self, block_size: int, prefix_caching: bool) -> None:
        super().__init__(block_size, prefix_caching)
        self.kept: dict[str, _Kept] = {}
        # Steps not allowed to skip (a hole past max_hole, or not contiguous), whatever
        # their plan: their first pass runs, and the round plans after it.
        self.refused_skips = 0
        self._rows: list[str] = []  # the batch's request ids, by row, for the hooks
        self._valid_end: np.ndarray | None = None

    def may_skip(self, proposer: Any, req_ids: Sequence[str], first_pos: np.ndarray,
                 query_lens: np.ndarray) -> bool:
        if (getattr(proposer, "needs_extra_input_slots", False)
                or getattr(proposer, "use_heterogeneous_vocab", False)):
            return False
        for rid, q, n in zip(req_ids, first_pos.tolist(), query_lens.tolist()):
            if rid in self.retired or self.retires(rid):
                continue  # nothing kept: skip() retires it
            kept = self.kept.get(rid)
            held = 0
            if kept is not None:
                if kept.end != int(q):  # not contiguous (recomputed): run the first pass
                    self.refused_skips += 1
                    return False
                held = kept.end - max(kept.pos0, self.start.get(rid, kept.pos0))
            if held + int(n) > self.max_hole:
                self.refused_skips += 1
                return False
        return True

    def forget(self, rid: str) -> None:
        self.kept.pop(rid, None)

    def keep_first_pass_inputs(self, proposer: Any, req_ids: Sequence[str],
                               target_token_ids: torch.Tensor, next_token_ids: torch.Tensor,
                               target_hidden_states: torch.Tensor,
                               token_indices_to_sample: torch.Tensor | None,
                               cad: CommonAttentionMetadata) -> None:
        """V1: keep each request's first-pass inputs at its accepted positions
        (:meth:`keep_rows`) from the runner's step: its query rows start at
        ``query_start_loc``, the last accepted one is ``token_indices_to_sample`` (the
        padded batch: rejected rows sit after it) or the query's last row."""
        num_reqs = len(req_ids)
        qsl = cad.query_start_loc_cpu[: num_reqs + 1].to(torch.int64)
        if token_indices_to_sample is None:
            last = qsl[1:] - 1
        else:
            last = token_indices_to_sample[:num_reqs].to("cpu", torch.int64)
        runner = getattr(proposer, "runner", None)
        self.keep_rows(req_ids, target_token_ids, next_token_ids, target_hidden_states,
                       qsl[:-1], last, runner.input_batch.num_computed_tokens_cpu[:num_reqs],
                       getattr(runner, "requests", None))

    def keep_rows(self, req_ids: Sequence[str], target_token_ids: torch.Tensor,
                  next_token_ids: torch.Tensor,
                  target_hidden_states: torch.Tensor | Sequence[torch.Tensor],
                  starts: torch.Tensor, last: torch.Tensor, first_pos: np.ndarray,
                  live: Container[str] | None) -> None:
        """Keep each request's first-pass inputs at its accepted positions, for any runner:
        the token fed at each position is the target's token at the next one (vLLM's
        first pass shifts the query's token ids by one), the step's new token at the last
        accepted row; the hidden state is the target's row there. ``starts``/``last``
        (host int64, [R]): each request's first and last accepted row of the step's
        tokens; ``first_pos``: its first query position. ``target_hidden_states`` may be
        EAGLE-3's auxiliary layers as a list (Model Runner V2 hands them over so): the
        kept rows are their concatenation, as V1's runner hands them over. ``live``: the
        runner's unfinished requests (None: keep every entry)."""
        num_reqs = len(req_ids)
        if self.retired and all(rid in self.retired for rid in req_ids):
            # Nothing is kept for a retired request: no gather of the step's rows (it ran
            # on every step of a batch that drafting never paid for).
            self._valid_end = None
            self._rows = list(req_ids)
            self._drop_finished(num_reqs, live)
            return
        n = target_token_ids.shape[0]
        ids = torch.empty_like(target_token_ids[:n])
        ids[: n - 1] = target_token_ids[1:n]
        ids[last.to(ids.device)] = next_token_ids[:num_reqs].to(ids.dtype)
        lens = last + 1 - starts  # accepted rows per request
        # One gather of every request's accepted rows (copies: vLLM reuses its buffers).
        rows = torch.repeat_interleave(starts - torch.cumsum(lens, 0) + lens, lens)
        rows += torch.arange(int(lens.sum()))
        rows = rows.to(ids.device)
        step_tokens = ids.index_select(0, rows).to(torch.int64)
        if isinstance(target_hidden_states, torch.Tensor):
            step_hidden = target_hidden_states.index_select(0, rows)
        else:
            step_hidden = torch.cat([h.index_select(0, rows) for h in target_hidden_states],
                                    dim=-1)
        valid_end = np.asarray(first_pos, dtype=np.int64) + lens.numpy()
        off = 0
        for i, rid in enumerate(req_ids):
            q, m = int(first_pos[i]), int(lens[i])
            tokens, hidden = step_tokens[off:off + m], step_hidden[off:off + m]
            off += m
            if rid in self.retired:
                continue
            kept = self.kept.get(rid)
            if kept is None or kept.end != q:
                kept = self.kept[rid] = _Kept(q, [], [])
            kept.append(tokens, hidden)
        self._valid_end = valid_end
        self._rows = list(req_ids)
        self._drop_finished(num_reqs, live)

    def _drop_finished(self, num_reqs: int, live: Container[str] | None) -> None:
        if live is not None and len(self.kept) > num_reqs:
            # Finished requests never come back (a preempted one stays in V1's runner's
            # requests and keeps its entry until its next first pass).
            self.kept = {r: v for r, v in self.kept.items() if r in live}

    def skip(self, proposer: Any, cad: CommonAttentionMetadata, req_ids: Sequence[str],
             first_pos: np.ndarray, query_lens: np.ndarray, committed: np.ndarray,
             token_ids_cpu: np.ndarray) -> None:
        # A block-end catch-up may reach only as far as the positions whose inputs are
        # kept (the last accepted one): vLLM caches no block beyond it this step.
        if self._valid_end is not None:
            committed = np.minimum(committed, self._valid_end)
        super().skip(proposer, cad, req_ids, first_pos, query_lens, committed, token_ids_cpu)
        for rid in req_ids:  # what a block-end catch-up wrote is no longer needed
            kept = self.kept.get(rid)
            if kept is not None and rid in self.start:
                kept.drop_before(self.start[rid])
        self._valid_end = None
        self.start = {r: h for r, h in self.start.items() if r in self.kept}

    def catch_up(self, proposer: Any, cad: CommonAttentionMetadata, req_ids: Sequence[str],
                 first_pos: np.ndarray, token_ids_cpu: np.ndarray,
                 merge_room: int = 0) -> dict[int, list[int]]:
        """Before a first pass: feed each of the batch's requests its kept inputs at the
        positions from its hole's start to the step's first query position (what is
        kept ends there unless the request was recomputed: then nothing is fed). Always
        in passes of their own (a head's first pass has no room for holes: ``merge_room``
        is 0), so nothing is left to the first pass."""
        if not self.start:
            return {}
        self._rows = list(req_ids)
        todo: dict[int, list[int]] = {}
        for i, rid in enumerate(req_ids):
            h = self.start.pop(rid, None)
            kept = self.kept.get(rid)
            if h is None or kept is None:
                continue
            a, b = max(h, kept.pos0), min(int(first_pos[i]), kept.end)
            if a < b:
                todo[i] = [a, b]
        self.catch_up_steps += bool(todo)
        self._catch_up_spans(proposer, cad, len(req_ids), todo, token_ids_cpu)
        for rid in req_ids:
            self.kept.pop(rid, None)
        return {}

    def fed_tokens(self, row: int, a: int, b: int, token_ids_cpu: np.ndarray) -> torch.Tensor:
        return self.kept[self._rows[row]].rows(a, b)[0]

    def before_catch_up_pass(self, proposer: Any, rows: list[int],
                             pieces: list[tuple[int, int]]) -> None:
        """The head reads its hidden-state input from the proposer's ``hidden_states``
        buffer (``run_model``): put the kept rows there, in the pass's token order."""
        hidden = torch.cat([self.kept[self._rows[i]].rows(a, b)[1]
                            for i, (a, b) in zip(rows, pieces)])
        # Kept as the runner handed them over: EAGLE-3's fc combines them now.
        hidden = proposer.first_pass_hidden(hidden)
        proposer.hidden_states[: hidden.shape[0]] = hidden

    def as_dict(self) -> dict[str, int]:
        return {**super().as_dict(), "refused_skips": self.refused_skips,
                "kept_positions": sum(k.n for k in self.kept.values())}
