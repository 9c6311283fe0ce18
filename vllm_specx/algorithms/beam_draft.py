"""Beam-search drafting for MTAD (multi-token assisted decoding: Qin et al., "Optimized
Multi-Token Joint Decoding with Auxiliary Model for LLM Inference").

Pure PyTorch, no vLLM import: the same code drives the in-vLLM drafter
(``vllm_specx.glue.mtad_proposer``) and the Hugging Face reference loop used in tests.

The search keeps, for every request (row) of a batch, ``num_beams`` partial drafts ("beams")
scored by the SUM of the draft model's warped log-probabilities of their tokens (the log of
their joint warped probability). One step extends every live beam by every vocabulary token
and keeps ``num_beams`` of the ``B x V`` continuations:

* greedy rows: the ``num_beams`` continuations with the highest joint log-probability;
* sampled rows: ``num_beams`` DISTINCT continuations drawn one after another without
  replacement, each draw in proportion to the joint probability of what is left. This is
  done with the Gumbel-top-k trick (perturb every joint log-probability with independent
  Gumbel noise and keep the top ``num_beams``), which has exactly that law and is
  vectorised over rows. The first step is the same operation with a single empty beam, so
  it draws ``num_beams`` distinct first tokens.

At the end the single beam with the highest joint log-probability is returned with its
per-token draft probabilities ``q_j`` (the warped probability of each chosen token given
that beam's own prefix; per token, not a beam score), which MTAD's joint verification
needs.

Rows with fewer continuations of nonzero probability than ``num_beams`` (e.g. top-k < B)
get "dead" beams whose score is ``-inf``. A dead beam is never kept while a finite
continuation is left, never chosen as the final beam while a finite one exists, and its
own continuations stay at ``-inf``. Nothing here produces NaN from that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

# Same threshold vLLM's sampler uses to call a request greedy (temperature ~ 0).
SAMPLING_EPS = 1e-5

NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------
# Warping
# --------------------------------------------------------------------------------------


def warp_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities of the request's warped distribution, row by row.

    ``logits``: [N, V]. ``temperature``/``top_k``/``top_p``: [N] or None (no warping of
    that kind). Follows vLLM's sampler order: divide by the temperature, then keep the
    top-k logits (ties at the k-th value are kept), then the smallest set of the most
    likely tokens whose mass reaches top_p (a token is kept when the mass strictly above
    it is below p, so at least one token survives). ``top_k <= 0`` or ``>= V`` and
    ``top_p >= 1`` mean "off" for that row.

    Greedy rows (temperature below ``SAMPLING_EPS``) get the plain, unwarped
    ``log_softmax(logits)``: greedy beam search ranks beams by the draft's own joint
    log-likelihood (as the MTAD reference does for temperature 0), and the q_j reported
    for them are only informational because greedy verification ignores them.
    Masked-out tokens get ``-inf``. Returns float32.
    """
    x = logits.float()
    vocab = x.shape[1]
    greedy = None
    if temperature is not None:
        temp = temperature.to(device=x.device, dtype=torch.float32)
        greedy = temp < SAMPLING_EPS
        # Greedy rows are divided by 1 so the division stays finite.
        x = x / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(1)

    if top_k is not None or top_p is not None:
        sorted_x, order = x.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_x, dtype=torch.bool)
        if top_k is not None:
            k = top_k.to(device=x.device, dtype=torch.long)
            k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
            kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
            keep &= sorted_x >= kth
        if top_p is not None:
            p = top_p.to(device=x.device, dtype=torch.float32).unsqueeze(1)
            probs = sorted_x.masked_fill(~keep, NEG_INF).softmax(dim=-1)
            mass_above = probs.cumsum(dim=-1) - probs
            keep &= (mass_above < p) | (p >= 1.0)
            # The most likely token always survives, whatever rounding did.
            keep[:, 0] = True
        sorted_x = sorted_x.masked_fill(~keep, NEG_INF)
        x = torch.empty_like(x).scatter_(1, order, sorted_x)

    logp = x.log_softmax(dim=-1)
    if greedy is not None and bool(greedy.any()):
        logp = torch.where(greedy.unsqueeze(1), logits.float().log_softmax(dim=-1), logp)
    return logp


def greedy_mask_from_temperature(
    temperature: torch.Tensor | None, num_rows: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """[N] bool: which rows are greedy. ``None`` temperature means all greedy (vLLM's
    convention: the sampling metadata drops the temperature when every request is greedy).
    """
    if temperature is None:
        return torch.ones(num_rows, dtype=torch.bool, device=device)
    return temperature.to(device=device) < SAMPLING_EPS


# --------------------------------------------------------------------------------------
# One beam step
# --------------------------------------------------------------------------------------


def gumbel_noise(
    num_rows: int,
    num_cols: int,
    device: torch.device | str,
    generators: Mapping[int, torch.Generator] | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Standard Gumbel noise [num_rows, num_cols], float32.

    Rows listed in ``generators`` (row index -> torch.Generator, vLLM's convention for
    seeded requests) draw only from their own generator, so a seeded request's drafts do
    not depend on which other requests share its batch. ``rows`` (bool [num_rows]) limits
    which rows need noise at all; a seeded row outside it does not advance its generator.
    """
    u = torch.rand(num_rows, num_cols, device=device)
    if generators:
        for row, gen in generators.items():
            if row >= num_rows or (rows is not None and not bool(rows[row])):
                continue
            u[row] = torch.rand(num_cols, device=device, generator=gen)
    # u == 0 would give -inf noise and could rank a finite continuation below a dead
    # (-inf) one; clamping keeps every perturbed finite score finite.
    u.clamp_(min=torch.finfo(u.dtype).tiny)
    return -torch.log(-torch.log(u))


@dataclass
class BeamStep:
    """Result of one selection step, for ``R`` rows and ``B`` new beams.

    Beams come in selection order: by score for greedy rows, in draw order for sampled
    rows (the first beam is the first draw).
    """

    scores: torch.Tensor  # [R, B] joint warped log-prob of each new beam (-inf: dead)
    parents: torch.Tensor  # [R, B] index of the beam each new beam extends
    tokens: torch.Tensor  # [R, B] token appended to the parent
    token_logprobs: torch.Tensor  # [R, B] warped log q of that token given the parent


def select_beams(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    num_beams: int,
    greedy: torch.Tensor,
    generators: Mapping[int, torch.Generator] | None = None,
) -> BeamStep:
    """Keep ``num_beams`` of the continuations of every row's beams.

    ``scores``: [R, Bp] joint log-prob of the current beams (use zeros [R, 1] for the first
    step). ``logprobs``: [R, Bp, V] warped next-token log-probs of each current beam.
    ``greedy``: [R] bool. Greedy rows keep the top ``num_beams`` continuations; the others
    draw ``num_beams`` distinct continuations without replacement, each draw in proportion
    to its joint probability (Gumbel-top-k).

    When a row has fewer than ``num_beams`` candidates (Bp * V < num_beams), the missing
    beams are dead: score ``-inf``, parent 0, token 0.
    """
    num_rows, prev_beams, vocab = logprobs.shape
    if scores.shape != (num_rows, prev_beams):
        raise ValueError(f"scores {tuple(scores.shape)} != logprobs[:2] {(num_rows, prev_beams)}")
    cand = (scores.float().unsqueeze(-1) + logprobs.float()).reshape(num_rows, -1)
    num_cand = cand.shape[1]
    keys = cand
    sampled = ~greedy.to(device=cand.device, dtype=torch.bool)
    if bool(sampled.any()):
        noise = gumbel_noise(num_rows, num_cand, cand.device, generators, rows=sampled)
        keys = torch.where(sampled.unsqueeze(1), cand + noise, cand)
    take = min(num_beams, num_cand)
    # topk puts every finite key before every -inf key, so a dead continuation is kept
    # only once the finite ones are exhausted.
    _, idx = keys.topk(take, dim=-1)
    new_scores = cand.gather(1, idx)
    parents = torch.div(idx, vocab, rounding_mode="floor")
    tokens = idx % vocab
    token_logprobs = logprobs.float().reshape(num_rows, -1).gather(1, idx)
    if take < num_beams:
        pad = num_beams - take
        new_scores = torch.cat([new_scores, new_scores.new_full((num_rows, pad), NEG_INF)], 1)
        token_logprobs = torch.cat(
            [token_logprobs, token_logprobs.new_full((num_rows, pad), NEG_INF)], 1
        )
        parents = torch.cat([parents, parents.new_zeros((num_rows, pad))], 1)
        tokens = torch.cat([tokens, tokens.new_zeros((num_rows, pad))], 1)
    return BeamStep(new_scores, parents, tokens, token_logprobs)


class StreamingSelector:
    """``select_beams`` with the current beams' log-probs fed one beam at a time.

    Every row keeps only its running top ``num_beams`` candidates, so memory is
    O(R * (V + B)) instead of the O(R * B * V) of materialising all continuations (with a
    100k+ vocabulary and hundreds of requests that difference is gigabytes). The top B of
    a union is the top B of the union of each part's top B, so greedy rows get exactly
    ``select_beams``'s beams (up to ties) and sampled rows the same law (the Gumbel noise of
    each continuation is still independent; it is drawn per fed beam, so the draws differ
    from ``select_beams``'s for the same generator state).

    ``add(parent, logprobs)``: ``parent`` [R] long, the beam (of the current ones) each row
    feeds, ``logprobs`` [R, V] its warped next-token log-probs. Rows may feed their beams
    in different orders; each beam of each row must be fed exactly once.
    """

    def __init__(
        self,
        scores: torch.Tensor,
        num_beams: int,
        greedy: torch.Tensor,
        generators: Mapping[int, torch.Generator] | None = None,
    ) -> None:
        self.scores = scores.float()
        self.num_beams = num_beams
        self.sampled = ~greedy.to(device=scores.device, dtype=torch.bool)
        self.any_sampled = bool(self.sampled.any())
        self.generators = generators
        rows = scores.shape[0]
        dev = scores.device
        self.keys = torch.empty(rows, 0, device=dev)
        self.cand = torch.empty(rows, 0, device=dev)
        self.parents = torch.empty(rows, 0, dtype=torch.long, device=dev)
        self.tokens = torch.empty(rows, 0, dtype=torch.long, device=dev)
        self.token_lp = torch.empty(rows, 0, device=dev)

    def add(self, parent: torch.Tensor, logprobs: torch.Tensor) -> None:
        rows, vocab = logprobs.shape
        parent = parent.to(device=logprobs.device, dtype=torch.long)
        lp = logprobs.float()
        cand = self.scores.gather(1, parent.view(-1, 1)) + lp
        keys = cand
        if self.any_sampled:
            noise = gumbel_noise(rows, vocab, cand.device, self.generators, rows=self.sampled)
            keys = torch.where(self.sampled.unsqueeze(1), cand + noise, cand)
        take = min(self.num_beams, vocab)
        top_keys, tok = keys.topk(take, dim=-1)
        merged_keys = torch.cat([self.keys, top_keys], 1)
        merged = (
            torch.cat([self.cand, cand.gather(1, tok)], 1),
            torch.cat([self.parents, parent.view(-1, 1).expand(-1, take)], 1),
            torch.cat([self.tokens, tok], 1),
            torch.cat([self.token_lp, lp.gather(1, tok)], 1),
        )
        keep = min(self.num_beams, merged_keys.shape[1])
        self.keys, idx = merged_keys.topk(keep, dim=-1)
        self.cand, self.parents, self.tokens, self.token_lp = (m.gather(1, idx) for m in merged)

    def result(self) -> BeamStep:
        """The kept beams, in selection order (padded with dead beams if too few)."""
        rows, have = self.keys.shape
        pad = self.num_beams - have
        scores, parents, tokens, token_lp = self.cand, self.parents, self.tokens, self.token_lp
        if pad > 0:
            scores = torch.cat([scores, scores.new_full((rows, pad), NEG_INF)], 1)
            token_lp = torch.cat([token_lp, token_lp.new_full((rows, pad), NEG_INF)], 1)
            parents = torch.cat([parents, parents.new_zeros((rows, pad))], 1)
            tokens = torch.cat([tokens, tokens.new_zeros((rows, pad))], 1)
        return BeamStep(scores, parents, tokens, token_lp)


# --------------------------------------------------------------------------------------
# Whole search state
# --------------------------------------------------------------------------------------


@dataclass
class BeamSearchState:
    """Beams of ``R`` rows after ``depth`` steps.

    ``tokens``/``token_logprobs`` hold each beam's full history ([R, B, depth]), already
    re-gathered along the parent links, so row r / beam b is always a coherent draft.
    ``parents`` keeps the parent index of every step ([R, B] each) for callers that must
    reorder per-beam state (e.g. a per-beam KV cache).
    """

    num_beams: int
    scores: torch.Tensor  # [R, B]
    tokens: torch.Tensor  # [R, B, depth] int64
    token_logprobs: torch.Tensor  # [R, B, depth] float32
    parents: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def start(cls, num_rows: int, num_beams: int, device: torch.device | str) -> BeamSearchState:
        """The empty state: one live empty beam per row (score 0)."""
        if num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {num_beams}")
        return cls(
            num_beams=num_beams,
            scores=torch.zeros(num_rows, 1, device=device),
            tokens=torch.zeros(num_rows, 1, 0, dtype=torch.long, device=device),
            token_logprobs=torch.zeros(num_rows, 1, 0, device=device),
        )

    @property
    def depth(self) -> int:
        return self.tokens.shape[2]

    @property
    def width(self) -> int:
        """Beams currently held (1 before the first step, then ``num_beams``)."""
        return self.tokens.shape[1]

    def step(
        self,
        logprobs: torch.Tensor,
        greedy: torch.Tensor,
        generators: Mapping[int, torch.Generator] | None = None,
    ) -> BeamSearchState:
        """Extend by one token. ``logprobs``: [R, width, V] (or [R, V] at depth 0)."""
        if logprobs.dim() == 2:
            logprobs = logprobs.unsqueeze(1)
        return self.apply(select_beams(self.scores, logprobs, self.num_beams, greedy, generators))

    def selector(
        self,
        greedy: torch.Tensor,
        generators: Mapping[int, torch.Generator] | None = None,
    ) -> StreamingSelector:
        """A ``StreamingSelector`` for the next step (feed it one beam at a time)."""
        return StreamingSelector(self.scores, self.num_beams, greedy, generators)

    def apply(self, sel: BeamStep) -> BeamSearchState:
        """The state after keeping the beams ``sel`` selected."""
        p = sel.parents.unsqueeze(-1).expand(-1, -1, self.depth)
        tokens = torch.cat([self.tokens.gather(1, p), sel.tokens.unsqueeze(-1)], dim=2)
        token_lp = torch.cat(
            [self.token_logprobs.gather(1, p), sel.token_logprobs.unsqueeze(-1)], dim=2
        )
        return BeamSearchState(
            num_beams=self.num_beams,
            scores=sel.scores,
            tokens=tokens,
            token_logprobs=token_lp,
            parents=[*self.parents, sel.parents],
        )

    def best(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The highest-scoring beam of every row: (tokens [R, depth], q [R, depth]).

        ``q`` holds probabilities (not logs): the draft's warped probability of each chosen
        token given that beam's prefix. Ties go to the lowest beam index.
        """
        best = self.scores.argmax(dim=1)
        idx = best.view(-1, 1, 1).expand(-1, 1, self.depth)
        tokens = self.tokens.gather(1, idx).squeeze(1)
        q = self.token_logprobs.gather(1, idx).squeeze(1).exp()
        return tokens, q


def beam_search(
    next_logprobs: Callable[[torch.Tensor], torch.Tensor],
    num_rows: int,
    num_beams: int,
    depth: int,
    greedy: torch.Tensor,
    generators: Mapping[int, torch.Generator] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, BeamSearchState]:
    """Run a whole depth-``depth`` search with a callback model.

    ``next_logprobs(tokens)`` gets the beams' drafts so far, [R, width, d] (d = 0 at the
    first call, width = 1 there), and returns their warped next-token log-probs
    [R, width, V]. Returns the best beam's (tokens [R, depth], q [R, depth]) and the final
    state.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    state = BeamSearchState.start(num_rows, num_beams, device)
    for _ in range(depth):
        state = state.step(next_logprobs(state.tokens), greedy, generators)
    tokens, q = state.best()
    return tokens, q, state


BeamLogprobs = Callable[[torch.Tensor], torch.Tensor]


def beam_search_batched(
    first_logprobs: torch.Tensor,
    depth: int,
    num_beams: int,
    forward: Callable[[BeamSearchState], BeamLogprobs],
    greedy: torch.Tensor,
    generators: Mapping[int, torch.Generator] | None = None,
    row_width: torch.Tensor | None = None,
    row_depth: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, BeamSearchState]:
    """MTAD's beam search with the draft model as a callback, one call per depth.

    ``row_width`` [R] (optional): keep at most that many beams in row r; the others die
    after every step. Width 1 on a greedy row is the argmax chain (greedy selection puts
    the best continuation first), and its dead beams cost the callback nothing.

    ``row_depth`` [R] (optional, values in ``0..depth``): row r stops at its own depth
    (cost control plans one per request). Once a row has its ``row_depth[r]`` tokens its
    best beam is taken there (the highest joint log-probability over those tokens only:
    what a search of depth ``row_depth[r]`` of that row alone returns) and all its beams
    die, so the callback feeds it nothing in the later passes (it takes no rows) and it
    draws nothing more: a finished row (and a row at depth 0 from the start) counts as
    greedy in selection, so a seeded row's generator advances exactly as in its own
    search. Its returned tokens and q past its depth are 0, and its beams in the returned
    state are dead (the state then describes only the rows that ran to ``depth``). The
    search stops at the deepest row's depth.

    ``first_logprobs`` [R, V]: the warped next-token log-probs after each row's context
    (the drafter's first pass). ``forward(state)`` is the model: it runs the draft over
    every live beam of ``state`` (``state.tokens`` [R, B, j], ``state.scores`` -inf for
    dead beams, ``state.parents`` the lineage) and returns ``beam_logprobs``, where
    ``beam_logprobs(beam)`` ([R] long: one beam index per row) gives those beams'
    warped next-token log-probs [R, V] (any finite values for dead beams: their -inf
    score keeps every continuation out). The in-vLLM drafter runs all beams of a depth in
    one batched forward pass (``glue/mtad_proposer.py``); the same search with a lazy
    callback recomputes one beam per pass.

    Each row's beams are fed to the step's selector in lexicographic order of their tails
    (``beam_tails.lexicographic_order``): a lazy callback then runs siblings back to back,
    and for a given generator state the draws do not depend on which callback ran.
    Selection streams one beam at a time (memory O(R * V), see ``StreamingSelector``).
    Returns the best beam's (tokens [R, depth], q [R, depth]) and the final state.
    """
    from vllm_specx.algorithms.beam_tails import lexicographic_order

    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    num_rows = first_logprobs.shape[0]
    dev = first_logprobs.device
    state = BeamSearchState.start(num_rows, num_beams, dev)
    caps: torch.Tensor | None = None  # host [R] int64
    if row_depth is not None:
        caps = row_depth.to("cpu", torch.int64).clamp(0, depth)
        if bool((caps >= depth).all()):
            caps = None  # every row runs the whole search: nothing to cut
        else:
            depth = max(int(caps.max()), 1)
            out_tokens = torch.zeros(num_rows, depth, dtype=torch.int64, device=dev)
            out_q = torch.zeros(num_rows, depth, device=dev)
            # A row at depth 0 never searches: no live beam, nothing drawn.
            state.scores = state.scores.masked_fill((caps == 0).to(dev).view(-1, 1), NEG_INF)
    state = _narrow(state.step(first_logprobs, _drawing(greedy, caps, 0), generators),
                    row_width)
    if caps is not None:
        state = _finish_rows(state, caps == 1, out_tokens, out_q)
    for j in range(1, depth):
        beam_logprobs = forward(state)
        order = lexicographic_order(state.tokens.to("cpu"))
        selector = state.selector(_drawing(greedy, caps, j), generators)
        for i in range(state.width):
            beam = order[:, i].to(dev)
            selector.add(beam, beam_logprobs(beam))
        state = _narrow(state.apply(selector.result()), row_width)
        if caps is not None:
            state = _finish_rows(state, caps == j + 1, out_tokens, out_q)
    if caps is not None:
        return out_tokens, out_q, state
    tokens, q = state.best()
    return tokens, q, state


def _drawing(greedy: torch.Tensor, caps: torch.Tensor | None, j: int) -> torch.Tensor:
    """The greedy mask of the selection that draws token ``j + 1``: a row whose depth is
    reached (``caps <= j``) counts as greedy, so it draws no noise and a seeded row's
    generator does not advance for a token it will not draft."""
    if caps is None:
        return greedy
    done = (caps <= j).to(greedy.device)
    return greedy.to(torch.bool) | done


def _finish_rows(state: BeamSearchState, rows: torch.Tensor, out_tokens: torch.Tensor,
                 out_q: torch.Tensor) -> BeamSearchState:
    """Rows ``rows`` (host bool [R]) reached their depth (``state.depth``): their best beam
    goes to ``out_tokens``/``out_q`` [R, :depth] and their beams die (the callback feeds
    dead beams nothing)."""
    if not bool(rows.any()):
        return state
    idx = rows.nonzero().squeeze(1).to(state.scores.device)
    best = state.scores[idx].argmax(dim=1)
    pick = best.view(-1, 1, 1).expand(-1, 1, state.depth)
    out_tokens[idx, : state.depth] = state.tokens[idx].gather(1, pick).squeeze(1)
    out_q[idx, : state.depth] = state.token_logprobs[idx].gather(1, pick).squeeze(1).exp()
    state.scores = state.scores.index_fill(0, idx, NEG_INF)
    return state


def _narrow(state: BeamSearchState, row_width: torch.Tensor | None) -> BeamSearchState:
    """Kill the beams of each row past its width (selection order: best first)."""
    if row_width is None:
        return state
    cols = torch.arange(state.width, device=state.scores.device)
    dead = cols.unsqueeze(0) >= row_width.to(state.scores.device).unsqueeze(1)
    state.scores = state.scores.masked_fill(dead, NEG_INF)
    return state


def recompute_tail_cost(num_beams: int, depth: int) -> int:
    """Draft tokens per request per round that "recompute the tail" spends after the
    first pass: at step j (1..depth-1) each of the B beams re-feeds its j-token tail."""
    return num_beams * depth * (depth - 1) // 2
