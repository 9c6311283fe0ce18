"""Draft trees from an EAGLE / EAGLE-3 head (``specx_eagle``, ``specx_eagle3`` with
``draft_tree``), verified in one target pass (vLLM glue, checked on vLLM 0.32 V1, CPU).

:class:`EagleTreeRound` is mixed into :class:`~.eagle_chain_proposer.EagleChainProposer`;
without a tree config (no ``tree_state``) it hands the round to the chain drafter
untouched. With one, a round is:

1. vLLM's **first pass** (``SpecxPasses.propose``, unchanged) gives the head's logits at
   the root (the token the target just emitted) and the hidden state the head feeds on.
2. **One head pass per depth** over the tree built so far. A dynamic tree is EAGLE-2's
   (:func:`~vllm_specx.algorithms.draft_tree.expand_frontier`): the top ``branching``
   children of each of the ``branching`` likeliest frontier nodes, the likeliest
   ``branching`` of them the next frontier. A static tree (``{"paths": ...}``, vLLM's old
   ``speculative_token_tree`` format) takes, for every node, the child ranks its paths
   name from the head's top-k after that node. Then
   :func:`~vllm_specx.algorithms.draft_tree.tree_from_beams` keeps the best ``max_nodes``
   nodes by joint draft probability (dynamic), in BFS order, and the round records each
   request's tree for the runner (``glue/tree_step.py``).
3. The target verifies every tree in one pass; the sampler walks it with the lossless
   ``"deterministic"`` rule (the children are the head's top-k, chosen without the
   verifier's randomness; greedy requests follow the target's argmax).

**The head's attention over a tree.** A fed node must see the target's context, its own
ancestors and itself, and sit at RoPE position ``P + depth``. Two ways were possible:
give every frontier path its own KV slots (the MTAD beams' scratch blocks,
``glue/beam_kv.py``: block-table copies, copy-on-write of the last block, bookkeeping of
which slot holds which tail), or use the ancestor-only query masks the CPU attention op
already takes for the target's tree pass (``cpu_ops.attention.QueryMasks``). The masks are
the simpler correct way here: the head is one layer, so each depth's pass feeds ALL the
nodes fed so far (at most ``(max_depth - 1) * branching``, a few dozen tokens) as one
query per request at the lookahead slots ``P+1 .., P+m`` with their ancestor mask, and
reads the outputs of the newest depth. The masks only order query rows against query rows
(everything before a request's first query row is visible), which is why earlier nodes are
fed again instead of being left in the KV cache: left there, every later node would see
all of them. Re-feeding costs ``m`` tokens per depth instead of ``branching``; no KV
slots beyond the ``num_speculative_tokens - 1`` lookahead slots vLLM reserves anyway
(``methods.head_tree_budget`` makes vLLM's ``num_speculative_tokens`` at least ``m + 1``)
and no copy. Each fed node's input hidden state is its parent's output (the root's: the
first pass's), as the chain feeds each token the state of the step before.

**The next round's first pass.** vLLM feeds the head the target's hidden states of the
step's query rows (its padded drafter batch: the step's own row layout; specx methods
refuse ``disable_padded_drafter_batch``). After a tree step the runner rewrites the
step's tokens and positions in the chain layout ``[root, path..., rest]``
(``TreeState.finish_step``); :meth:`EagleTreeRound.path_rows_in_chain_order` moves the
accepted nodes' hidden-state rows the same way, so the first pass sees exactly the chain
it would have seen had the path been drafted as one (and rewrites the head's KV there).

**Steps that draft nothing.** With cost control (a dynamic tree's default) the round's
depth is chosen before vLLM's first pass (:meth:`EagleTreeRound.plan_before_first_pass`,
called where the chain rounds plan: ``SpecxPasses.propose`` on V1,
``plan_or_skip_first_pass`` on Model Runner V2). Depth 0 skips that pass as a chain step
where nobody drafts does: the head keeps the pass's inputs, in the chain layout above, and
catches its KV up before the next first pass that runs (``glue/head_kv_holes.py``); a
request idle long enough retires and none of its nodes is verified again.

vLLM private names relied on (beyond ``draft_passes.py``'s): the proposer's
``_get_positions`` (the positions a pass's model call reads) and ``max_num_tokens``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_specx.glue.cost_model import retired_requests
from vllm_specx.glue.draft_passes import RoundStart
from vllm_specx.glue.tree_cost import (
    TreeRoundPlan,
    apply_keep,
    requests_that_may_draft,
    tree_cost_control_for,
    tree_cost_stats,
)


class EagleTreeRound:
    """The tree round over an EAGLE head (see the module doc), mixed in before the chain
    round; a no-op (the chain round) unless the runner hook set :attr:`tree_state`."""

    # The runner's TreeState (glue/tree_step.py): set by the runner hook when draft_tree
    # is on; None drafts chains.
    tree_state: Any = None
    # RoPE positions of the tree pass running now ([tokens]), read by _get_positions;
    # None outside tree passes (every other pass reads vLLM's positions).
    _tree_rope: torch.Tensor | None = None
    # The last tree pass's full output ([tokens, ...]), kept by run_model.
    _tree_pass_out: torch.Tensor | None = None
    # The tree cost control (glue/tree_cost.tree_cost_control_for), made on first use.
    _tree_cost: Any = None

    settings: dict[str, Any]
    model: Any
    max_num_tokens: int
    max_model_len: int
    hidden_states: torch.Tensor

    # -- hooks over vLLM's proposer ---------------------------------------------------

    def _get_positions(self, num_tokens: int) -> torch.Tensor:
        positions = super()._get_positions(num_tokens)  # type: ignore[misc]
        rope = self._tree_rope
        if rope is None:
            return positions
        positions = positions.clone()
        positions[: rope.shape[0]] = rope.to(positions.device, positions.dtype)
        return positions

    def keep_tree_pass_output(self, out: torch.Tensor) -> None:
        """Called by ``run_model`` with a pass's full output (every row, not only the
        rows ``LookaheadPasses`` returns): a tree pass reads several rows per request."""
        if self._tree_rope is not None:
            self._tree_pass_out = out

    def path_rows_in_chain_order(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states of the step just verified, with each tree request's
        accepted nodes' rows moved to the chain rows after its root (in place; see the
        module doc). A no-op after a step without tree requests."""
        state = self.tree_state
        step = getattr(state, "last_step", None) if state is not None else None
        if step is None:
            return hidden
        state.last_step = None
        return path_rows_to_chain(step, hidden)

    def specx_stats(self) -> dict[str, Any]:
        return tree_cost_stats(self, super().specx_stats())  # type: ignore[misc]

    # -- the round ----------------------------------------------------------------------

    def _tree_shape_and_control(self) -> tuple[dict[str, Any], Any]:
        from vllm_specx.methods import head_tree

        shape = head_tree(self.settings)
        assert shape is not None, "a tree state without a head tree config"
        # Cost control prunes dynamic trees only: a static {"paths"} tree is drafted to
        # the shape the user gave, node for node.
        return shape, None if "paths" in shape else tree_cost_control_for(self)

    def plan_before_first_pass(
        self, k: int, req_ids: tuple[str, ...], num_rejected: torch.Tensor | None,
        target_tokens: int,
    ) -> Any:
        """With a tree, the tree cost control's depth for the round, chosen before the
        first pass (see the module doc): the round, first pass included, is timed from
        here, and depth 0 (:class:`TreeRoundPlan` with ``skip_first_pass``) is a plain
        step that skips that pass. None (no control: a static tree, or ``cost_control``
        off): the round drafts as configured. Without a tree, the chain round's plan."""
        if self.tree_state is None:
            return super().plan_before_first_pass(  # type: ignore[misc]
                k, req_ids, num_rejected, target_tokens)
        shape, control = self._tree_shape_and_control()
        if control is None:
            return None
        control.begin(req_ids, num_rejected, target_tokens)
        depth = control.choose_depth(requests_that_may_draft(self, req_ids),
                                     int(shape["max_depth"]), skips_first_pass=True)
        if depth > 0:
            return TreeRoundPlan(depth, skip_first_pass=False)
        control.skipped(req_ids)
        empty = [torch.empty(0, dtype=torch.int64) for _ in req_ids]
        self.tree_state.record_round(list(req_ids), empty, empty)
        self.stats.record([0] * len(req_ids), k, 0, 0, 0)  # type: ignore[attr-defined]
        return TreeRoundPlan(0, skip_first_pass=True)

    def draft_round(
        self, start: RoundStart, sampling_metadata: SamplingMetadata
    ) -> list[list[int]] | torch.Tensor:
        if self.tree_state is None:
            return super().draft_round(start, sampling_metadata)  # type: ignore[misc]
        shape, control = self._tree_shape_and_control()
        if start.k == 0:
            if control is not None:
                control.forget_interval()
            return start.no_drafts()
        # The depth chosen before the first pass (None: the first pass ran unplanned, a
        # hole too long to skip it or a runner that does not plan; the round plans now).
        plan = start.plan if isinstance(start.plan, TreeRoundPlan) else None
        if plan is not None and plan.skip_first_pass:
            # Depth 0 and the first pass ran (a drafter told not to skip it): the plan
            # already ended and recorded the round.
            return [[] for _ in range(start.num_reqs)]
        if control is not None and plan is None:
            control.begin(start.req_ids, start.num_rejected, start.target_tokens)
        lm_in, fed_back = self.read_pass(start.out)  # type: ignore[attr-defined]
        root_lp = self._logprobs(lm_in)  # [R, V]
        passes = self.lookahead_passes(  # type: ignore[attr-defined]
            start.cad, start.sample_positions, start.base_seq_lens)
        tree = _HeadTree(self, passes, start, fed_back)
        runner = self.runner  # type: ignore[attr-defined]
        num_reqs = start.num_reqs
        # V1 gives the ids through its input batch, V2 through the round start; the live
        # requests are V1's runner.requests or V2's request states.
        req_ids = list(start.req_ids if start.req_ids is not None
                       else runner.input_batch.req_ids[:num_reqs])
        depth = int(shape.get("max_depth", 0)) if "paths" not in shape else 0
        if control is not None:
            # The head passes are paid before the tree exists: their number is chosen
            # from what the last rounds' pruned trees were worth per depth.
            depth = plan.depth if plan is not None else control.choose_depth(
                requests_that_may_draft(self, req_ids), depth)
        if "paths" in shape:
            tokens, parents = tree.static(root_lp, shape["paths"])
        elif depth == 0:
            tokens = [torch.empty(0, dtype=torch.int64) for _ in range(num_reqs)]
            parents = [torch.empty(0, dtype=torch.int64) for _ in range(num_reqs)]
        else:
            tokens, parents = tree.dynamic(root_lp, {**shape, "max_depth": depth})
        live = getattr(runner, "requests", None)
        if live is None:
            live = runner.req_states.req_id_to_index
        if control is not None and depth == 0:
            control.skipped(req_ids)
        elif control is not None:
            # Keep per request the nodes that pay at the measured costs (glue/tree_cost.py);
            # the head's passes are paid already. Zero nodes: the request verifies nothing.
            keep = control.prune(req_ids, parents, tree.node_logq, tree.passes, tree.rows,
                                 retired=retired_requests(self))
            cut = [apply_keep(t, p, k) for t, p, k in zip(tokens, parents, keep)]
            tokens, parents = [c[0] for c in cut], [c[1] for c in cut]
            control.end(tree.passes, tree.rows)
        self.tree_state.record_round(req_ids, tokens, parents, live_req_ids=live)
        lengths = [int(t.shape[0]) for t in tokens]
        self.stats.record(lengths, start.k, start.first_tokens,  # type: ignore[attr-defined]
                          tree.passes, tree.rows)
        return [t.tolist() for t in tokens]

    def _logprobs(self, lm_in: torch.Tensor) -> torch.Tensor:
        # The head's own (unwarped) distribution ranks the children: any choice made
        # without the verifier's randomness keeps the "deterministic" rule lossless.
        return torch.log_softmax(self.model.compute_logits(lm_in).to(torch.float32), dim=-1)


class _HeadTree:
    """One round's tree passes: the nodes fed so far (by depth, ``[R, m]``), each one's
    parent among them (-1: the root), its depth and its input hidden state."""

    def __init__(self, proposer: Any, passes: Any, start: RoundStart,
                 root_hidden: torch.Tensor) -> None:
        self.p = proposer
        self.passes = 0
        self.rows = 0
        self.lookahead = passes
        self.start = start
        self.num_reqs = start.num_reqs
        # vLLM reserves lookahead slots P+1 .. P+k-1 (its k this step): the fed nodes' KV.
        self.max_fed = max(start.k - 1, 0)
        self.root_hidden = root_hidden  # [R, H]
        self.tokens = torch.empty(self.num_reqs, 0, dtype=torch.int64)
        self.parents = torch.empty(self.num_reqs, 0, dtype=torch.int64)
        self.depths: list[int] = []
        self.hidden_in: list[torch.Tensor] = []  # per fed node, [R, H]
        # A dynamic tree's nodes' cumulative draft log-probabilities, per request (the
        # tree cost control's values); None for a static tree.
        self.node_logq: list[torch.Tensor] | None = None

    def feed(self, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
             hidden_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``w`` nodes of depth ``depth`` (``tokens``/``parents`` [R, w], parents as
        fed-node indices, ``hidden_in`` [R, w, H]) and run one head pass over every fed
        node; returns the new nodes' (LM-head input, fed-back hidden), [R, w, H] each."""
        w = tokens.shape[1]
        self.tokens = torch.cat([self.tokens, tokens.to("cpu", torch.int64)], dim=1)
        self.parents = torch.cat([self.parents, parents.to("cpu", torch.int64)], dim=1)
        self.depths += [depth] * w
        self.hidden_in += list(hidden_in.unbind(1))
        return self._pass(w)

    def _pass(self, newest: int) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm_specx.cpu_ops.attention import QueryMasks, query_masks

        p, n, m = self.p, self.num_reqs, self.tokens.shape[1]
        allowed = _ancestor_masks(self.parents)  # [R, m, m]
        hidden = torch.stack(self.hidden_in, dim=1)  # [R, m, H]
        depth = torch.tensor(self.depths, dtype=torch.int64)
        positions = self.lookahead.positions_cpu  # P per request
        rope = (positions.unsqueeze(1) + depth.unsqueeze(0)).clamp(max=p.max_model_len - 1)
        lm_parts, fed_parts = [], []
        per_pass = max(1, p.max_num_tokens // m)
        for lo in range(0, n, per_pass):
            hi = min(n, lo + per_pass)
            rows = torch.arange(lo, hi)
            masks = QueryMasks.causal_except([m] * (hi - lo),
                                             {i: allowed[r] for i, r in enumerate(range(lo, hi))})
            p.feed_hidden(hidden[lo:hi].reshape((hi - lo) * m, -1))
            p._tree_rope = rope[lo:hi].reshape(-1)
            try:
                with query_masks(masks):
                    self.lookahead.run(rows, self.tokens[lo:hi],
                                       torch.zeros(hi - lo, dtype=torch.int64))
                out = p._tree_pass_out
            finally:
                p._tree_rope = None
                p._tree_pass_out = None
            assert out is not None
            # Row-major: request i's tokens are rows i*m .. i*m + m - 1; the newest depth's
            # nodes are its last `newest`.
            idx = (torch.arange(hi - lo).unsqueeze(1) * m
                   + torch.arange(m - newest, m).unsqueeze(0)).reshape(-1)
            lm_in, fed = p.read_pass(out[idx.to(out.device)])
            lm_parts.append(lm_in.reshape(hi - lo, newest, -1))
            fed_parts.append(fed.reshape(hi - lo, newest, -1))
            self.passes += 1
            self.rows += hi - lo
        return torch.cat(lm_parts, 0), torch.cat(fed_parts, 0)

    # -- a dynamic (EAGLE-2) tree ---------------------------------------------------------

    def dynamic(self, root_lp: torch.Tensor, shape: dict[str, Any]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        from vllm_specx.algorithms.draft_tree import expand_frontier, tree_from_beams

        n = self.num_reqs
        k = int(shape["branching"])
        # Depths the reserved slots can feed ((depth - 1) * k fed nodes), when vLLM asks
        # for fewer tokens than the configured budget.
        depth_max = min(int(shape["max_depth"]), self.max_fed // k + 1)
        exp = expand_frontier(root_lp.unsqueeze(1), root_lp.new_zeros(n, 1), None, k, k)
        levels = [exp]
        fed_back: torch.Tensor | None = None  # the last pass's outputs, [R, k, H]
        for depth in range(1, depth_max):
            cols = exp.frontier  # [R, k] columns among this depth's candidates
            tokens = exp.tokens.gather(1, cols)
            if depth == 1:
                parents = torch.full((n, k), -1, dtype=torch.int64)
                hidden_in = self.root_hidden.unsqueeze(1).expand(-1, k, -1)
            else:
                # Frontier node j's children are candidate columns j*k .. j*k + k - 1; it
                # is fed node (depth - 2) * k + j.
                j = torch.div(cols, k, rounding_mode="floor")
                parents = (depth - 2) * k + j.to("cpu")
                assert fed_back is not None
                hidden_in = fed_back.gather(
                    1, j.to(fed_back.device).unsqueeze(2).expand(-1, -1, fed_back.shape[2]))
            lm_in, fed_back = self.feed(tokens, parents, depth, hidden_in)
            lp = self.p._logprobs(lm_in.reshape(n * k, -1)).view(n, k, -1)
            exp = expand_frontier(lp, exp.frontier_scores, exp.frontier, k, k)
            levels.append(exp)
        max_nodes = min(int(shape["max_nodes"]), self.start.k)
        tree = tree_from_beams([e.tokens for e in levels], [e.parents for e in levels],
                               [e.scores for e in levels], max_nodes)
        counts = tree.num_nodes.tolist()
        tokens_cpu, parents_cpu = tree.token_ids.to("cpu"), tree.parents.to("cpu")
        scores_cpu = tree.scores.to("cpu")
        self.node_logq = [scores_cpu[r, : counts[r]] for r in range(n)]
        return ([tokens_cpu[r, : counts[r]] for r in range(n)],
                [parents_cpu[r, : counts[r]] for r in range(n)])

    # -- a static tree ----------------------------------------------------------------

    def static(self, root_lp: torch.Tensor, paths: list[list[int]]
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        from vllm_specx.algorithms.draft_tree import tree_from_paths

        n = self.num_reqs
        shape = tree_from_paths(paths)
        parents = list(shape.parents)
        depths = list(shape.depths)
        ranks = list(shape.child_ranks)
        has_children = {q for q in parents if q >= 0}
        # Keep the nodes whose parent can be fed within the reserved slots (BFS order:
        # inner nodes are fed depth by depth) and at most vLLM's k this step.
        inner = [i for i in range(len(parents)) if i in has_children]
        fed_ok = set(inner[: self.max_fed])
        keep = [i for i in range(len(parents)) if parents[i] < 0 or parents[i] in fed_ok]
        keep = keep[: self.start.k]
        kept = set(keep)
        node_tokens = torch.zeros(n, len(parents), dtype=torch.int64)
        # The head's log-probs after each inner node (the root: -1), [R, V].
        after: dict[int, torch.Tensor] = {-1: root_lp}
        fed_index: dict[int, int] = {}  # node -> its index among the fed nodes
        out_hidden: dict[int, torch.Tensor] = {-1: self.root_hidden}
        for depth in range(1, shape.max_depth + 1):
            level = [i for i in keep if depths[i] == depth]
            if not level:
                break
            for i in level:
                top = after[parents[i]].topk(ranks[i] + 1, dim=-1).indices[:, ranks[i]]
                node_tokens[:, i] = top.to("cpu")
            to_feed = [i for i in level if i in fed_ok and any(
                parents[c] == i for c in kept)]
            if not to_feed:
                continue
            base = self.tokens.shape[1]
            for offset, i in enumerate(to_feed):
                fed_index[i] = base + offset
            fed_parents = torch.tensor(
                [[fed_index.get(parents[i], -1) for i in to_feed]] * n, dtype=torch.int64)
            hidden_in = torch.stack([out_hidden[parents[i]] for i in to_feed], dim=1)
            lm_in, fed_back = self.feed(node_tokens[:, to_feed], fed_parents, depth, hidden_in)
            lp = self.p._logprobs(lm_in.reshape(n * len(to_feed), -1)).view(n, len(to_feed), -1)
            for col, i in enumerate(to_feed):
                after[i] = lp[:, col]
                out_hidden[i] = fed_back[:, col]
        # `keep` is a BFS prefix-closed subset in BFS order: renumber its parents.
        new_index = {i: j for j, i in enumerate(keep)}
        tree_parents = torch.tensor([new_index[parents[i]] if parents[i] >= 0 else -1
                                     for i in keep], dtype=torch.int64)
        tokens = node_tokens[:, keep]
        return [tokens[r] for r in range(n)], [tree_parents.clone() for _ in range(n)]


def _ancestor_masks(parents: torch.Tensor) -> torch.Tensor:
    """``[R, m, m]`` masks over the fed nodes (parents ``[R, m]``, earlier indices, -1:
    the root): node ``i`` sees its ancestors and itself."""
    n, m = parents.shape
    allowed = torch.zeros(n, m, m, dtype=torch.bool)
    rows = torch.arange(n)
    for i in range(m):
        par = parents[:, i]
        inherited = allowed[rows, par.clamp(min=0)] & (par >= 0).unsqueeze(1)
        allowed[:, i] = inherited
        allowed[:, i, i] = True
    return allowed


def path_rows_to_chain(step: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Moves each tree request's accepted nodes' rows of ``hidden`` (one row per query
    token of the verified step, V1 or V2) to the chain rows after its root, in place."""
    for tree in step.trees:
        path = step.accepted.get(tree.row) or []
        a = len(path)
        if a == 0 or path == list(range(a)):
            continue
        src = tree.start + 1 + torch.tensor(path, dtype=torch.int64, device=hidden.device)
        # Advanced indexing reads every source row before any is written.
        hidden[tree.start + 1: tree.start + 1 + a] = hidden[src]
    return hidden
