"""The specx rejection sampler on Model Runner V2 (vLLM 0.32's ``vllm/v1/worker/gpu/``).

V2 verifies drafts with its own ``RejectionSampler`` (``spec_decode/rejection_sampler.py``),
built in ``GPUModelRunner.load_model``. For a specx method that runs on V2 the
``v2_specx_sampler`` patch (``glue/v2_patches.py``) replaces it, right after ``load_model``, by
:class:`SpecxV2RejectionSampler`: V2's class with only its ``_verify`` step replaced, so
everything around it stays vLLM's -- the draft tokens gathered from the batch
(``gather_draft_sampled``), chunking, logprobs of the emitted tokens, ``num_sampled`` /
``num_rejected`` bookkeeping, NaN counting. vLLM's own methods (``eagle3``, ``mtp``,
``draft_model`` ...) keep vLLM's sampler.

``_verify`` here:

* warps the target logits exactly as V2 warps them for its own verification
  (``Sampler.apply_sampling_params``: logits processors, penalties, bad words, logit
  bias, temperature, min-p, top-k / top-p);
* emits the bonus / extra token itself, from the warped logits of each request's last
  row: the argmax for greedy requests (V2's own greedy sample), else
  ``argmax(p / Exp(1))`` (an exact draw from ``p``); it reaches the rule as a one-hot
  bonus distribution, as on V1;
* runs the method's rule (``MethodSpec.rule``: ``standard`` or ``mtad``) through the
  device backend's ``verify`` (:mod:`vllm_specx.backends`), the same call the V1 sampler
  makes (``glue/sampler.py``).

Randomness: V2 has no per-request ``torch.Generator``; every request has a seed (its own,
or one V2 drew) in ``sampling_states.seeds``. The acceptance uniforms and the residual's
exponential noise of a request are drawn from a generator seeded with (that seed, the
position of its first verified row), so a seeded request gives the same output run to run,
as vLLM's V2 Gumbel sampling does.

Draft probabilities ``q``: a specx speculator that drafts from a distribution (sampled
drafts of ``adaptive``; MTAD's per-token ``q_j``) stores them with
:func:`store_draft_q` in V2's own layout, by request-state row and draft position
(``draft_q_by_state``: ``[max_num_reqs, K, V]`` full ``q`` or ``[max_num_reqs, K]`` for
the drafted token only), the way V2 keeps ``draft_logits``. Without it drafts are
one-hot (the EAGLE / MTP family and every argmax draft): the standard rule accepts
``x`` with probability ``p(x)`` and resamples from ``p`` without ``x``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

from vllm_specx.algorithms.verify import VerifyBatch, verify_greedy
from vllm_specx.backends.base import Backend
from vllm_specx.methods import METHODS

logger = logging.getLogger("vllm.specx")

__all__ = ["SpecxV2RejectionSampler", "install_v2_sampler", "store_draft_q"]

# Seeds of the per-request generators: (V2's request seed, first verified position).
_SEED_MIX = 1_000_003


def store_draft_q(speculator: Any, idx_mapping: torch.Tensor, q: torch.Tensor | None,
                  max_num_reqs: int) -> None:
    """Keep a round's draft probabilities for the specx sampler, by request-state row.

    ``q``: ``[num_reqs, K, V]`` (full draft distribution per draft position) or
    ``[num_reqs, K]`` (the drafted token's probability, MTAD), rows in the order of the
    round's batch (``idx_mapping``: request-state rows); None: this round's drafts are
    one-hot (the buffer is dropped)."""
    if q is None:
        speculator.draft_q_by_state = None
        return
    shape = (max_num_reqs, *q.shape[1:])
    buf = getattr(speculator, "draft_q_by_state", None)
    if buf is None or tuple(buf.shape) != shape or buf.device != q.device:
        buf = torch.zeros(shape, dtype=torch.float32, device=q.device)
    buf[idx_mapping[: q.shape[0]].long()] = q.to(torch.float32)
    speculator.draft_q_by_state = buf


def _mtad_threshold(settings: dict[str, Any], rule: str) -> float:
    return float(settings["acceptance_threshold"]) if rule == "mtad" else 1.0


@dataclass
class _StepDrafts:
    """A step's drafts over V2's logits layout, as :meth:`SpecxV2RejectionSampler.verify_rows`
    lays them out for the rules: ``draft_rows`` are the logits rows that verify a draft
    (every row of a request but its last), ``last_rows`` each request's last row (its
    bonus token), ``row_argmax`` every row's greedy token, ``drafts`` the draft each draft
    row verifies (-1: a placeholder), ``num_drafts`` / ``cu_drafts`` per request."""

    draft_rows: torch.Tensor
    last_rows: torch.Tensor
    row_argmax: torch.Tensor
    drafts: torch.Tensor
    num_drafts: list[int]
    cu_drafts: torch.Tensor
    max_spec_len: int


class SpecxV2RejectionSampler(RejectionSampler):
    """V2's ``RejectionSampler`` with the specx verification rule in ``_verify``."""

    def __init__(self, sampler: Any, spec_config: Any, device: Any, settings: dict[str, Any],
                 backend: Backend, speculator: Any) -> None:
        super().__init__(sampler, spec_config, device)
        self.rule = METHODS[settings["method"]].rule
        self.acceptance_threshold = _mtad_threshold(settings, self.rule)
        self.backend = backend
        self.speculator = speculator

    def _verify(self, logits: torch.Tensor, draft_logits: torch.Tensor | None,
                draft_sampled: torch.Tensor, pos: torch.Tensor, cu_num_logits: torch.Tensor,
                idx_mapping: torch.Tensor, idx_mapping_np: np.ndarray,
                expanded_idx_mapping: torch.Tensor, expanded_local_pos: torch.Tensor,
                seq_lens_upper_bound_np: np.ndarray, verify_draft_sampled: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """V2's ``_verify`` contract: returns (the warped logits, ``[num_reqs, K + 1]``
        emitted tokens, ``[num_reqs]`` how many of them are valid)."""
        processed = self.sampler.apply_sampling_params(
            logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, draft_sampled,
            expanded_local_pos, seq_lens_upper_bound_np,
        )
        sampled, num_sampled = self.verify_rows(
            processed, verify_draft_sampled, cu_num_logits, pos, idx_mapping,
            idx_mapping_np, expanded_idx_mapping, expanded_local_pos)
        if self.tree_state is not None and self.tree_state.step is not None:
            self.verify_trees(processed, logits, sampled, num_sampled, cu_num_logits, pos,
                              idx_mapping_np)
        return processed, sampled, num_sampled

    # Draft trees (glue/v2_tree_step.py): the runner's TreeState when a tree config is on
    # (install_v2_sampler sets it).
    tree_state: Any = None

    def verify_trees(self, processed: torch.Tensor, logits: torch.Tensor,
                     sampled: torch.Tensor, num_sampled: torch.Tensor,
                     cu_num_logits: torch.Tensor, pos: torch.Tensor,
                     idx_mapping_np: np.ndarray) -> None:
        """Re-verify this chunk's tree requests with the tree rule, in place.

        :meth:`verify_rows` read every request's drafts as a chain (a tree request's BFS
        nodes too: that verdict is discarded here). A tree request's ``n + 1`` rows
        (after the root, after each node) are the ``node_probs`` of
        :func:`~vllm_specx.algorithms.draft_tree.verify_tree`, warped as V2 warps them
        (``processed``); the request's output row becomes the accepted path plus one
        token, and the accepted nodes are left in the step for the KV compaction. The
        rows of ``processed`` and ``logits`` are then reordered so that V2's logprobs
        (read from row ``j`` for the ``j``-th emitted token) read each emitted token's
        own row: its parent node's."""
        from vllm_specx.algorithms.draft_tree import TreeBatch, verify_tree

        step = self.tree_state.step
        chunk_row = {int(state): r for r, state in enumerate(idx_mapping_np)}
        trees = [(t, chunk_row[t.state_index]) for t in step.trees
                 if t.state_index in chunk_row]
        if not trees:
            return
        device = processed.device
        cu = self._host_cu_num_logits(cu_num_logits, idx_mapping_np, processed.shape[0])
        for tree, r in trees:
            if int(cu[r + 1] - cu[r]) != tree.parents.shape[0] + 1:
                raise RuntimeError(
                    f"vllm-specx: tree request row {tree.row} has {int(cu[r + 1] - cu[r])} "
                    f"logits rows for {tree.parents.shape[0]} nodes")
        rows = torch.cat([torch.arange(int(cu[r]), int(cu[r + 1])) for _, r in trees])
        node_logits = processed[rows.to(device)].to(torch.float32)
        target_argmax = node_logits.argmax(dim=-1)
        sampling = self.sampler.sampling_states
        states = [tree.state_index for tree, _ in trees]
        is_greedy = torch.from_numpy(sampling.temperature.np[states] == 0.0).to(device)
        all_greedy = bool(is_greedy.all())
        node_probs = node_logits if all_greedy else node_logits.softmax(dim=-1)
        vocab_size = node_logits.shape[1]
        num_nodes = [tree.parents.shape[0] for tree, _ in trees]
        uniforms = torch.empty(int(sum(num_nodes)), dtype=torch.float32, device=device)
        exp_noise = torch.empty(len(trees), vocab_size, dtype=torch.float32, device=device)
        seeds = sampling.seeds.np[states]
        pos_cpu = pos.to("cpu", torch.int64)
        offset = 0
        for i, (_, r) in enumerate(trees):
            # Seeded by (the request's seed, its first verified position), as verify_rows.
            gen = torch.Generator(device=device)
            gen.manual_seed((int(seeds[i]) * _SEED_MIX + int(pos_cpu[int(cu[r])]))
                            % (2**63 - 1))
            uniforms[offset: offset + num_nodes[i]] = torch.rand(
                num_nodes[i], generator=gen, device=device)
            self.backend.fill_exp_noise(exp_noise[i], gen)
            offset += num_nodes[i]
        q = q_rows = None
        q_by_state = getattr(self.speculator, "draft_q_by_state", None)
        if q_by_state is not None and q_by_state.ndim == 2:
            q = torch.cat([q_by_state[s, :n] for s, n in zip(states, num_nodes)])
        elif self.rule == "mtad":
            q = torch.ones(int(sum(num_nodes)), dtype=torch.float32, device=device)
        elif (q_by_state is not None and q_by_state.ndim == 3
              and q_by_state.shape[2] == vocab_size):
            # A draft-model tree with i.i.d. children (glue/sampled_tree_round.py): node
            # i's row is the q its parent's children were drawn from (a cut tree: the
            # first n nodes of the BFS list, the scheduler's prefix).
            q_rows = torch.cat([q_by_state[s, :n] for s, n in zip(states, num_nodes)])
        batch = TreeBatch(
            token_ids=torch.cat([tree.tokens for tree, _ in trees]).to(device),
            parents=torch.cat([tree.parents for tree, _ in trees]).to(device),
            cu_num_nodes=torch.tensor(np.cumsum(num_nodes), dtype=torch.int64, device=device),
        )
        # The lossless rule for a draft-model tree, as on V1 (glue/sampler.py): "sampled"
        # (SpecInfer) when the drafter stored the q rows its i.i.d. children were drawn
        # from; otherwise "deterministic" (children chosen without the verifier's
        # randomness: top-k trees, the EAGLE heads' trees), which reads no q.
        tree_rule = {"mtad": "mtad", "standard": "deterministic"}.get(self.rule)
        if q_rows is not None and tree_rule == "deterministic":
            tree_rule = "sampled"
        if tree_rule is None:
            raise NotImplementedError(
                f"vllm-specx: tree verification with the {self.rule!r} rule is not wired yet")
        verdict = verify_tree(
            batch, node_probs, rule=tree_rule, is_greedy=is_greedy, exp_noise=exp_noise,
            uniforms=uniforms, target_argmax=target_argmax, draft_token_probs=q,
            draft_probs=q_rows, acceptance_threshold=self.acceptance_threshold,
            all_greedy=all_greedy,
        )
        accepted = verdict.num_accepted.tolist()
        for i, (tree, r) in enumerate(trees):
            a = int(accepted[i])
            sampled[r] = 0
            sampled[r, : a + 1] = verdict.output_token_ids[i, : a + 1].to(sampled.dtype)
            num_sampled[r] = a + 1
            path = verdict.accepted_nodes[i, :a].tolist()
            step.accepted[tree.row] = path
            first = int(cu[r])
            src = torch.tensor([first] + [first + 1 + node for node in path], device=device)
            dst = torch.arange(first, first + a + 1, device=device)
            for rows_of in {id(processed): processed, id(logits): logits}.values():
                rows_of[dst] = rows_of[src].clone()

    def verify_rows(self, processed: torch.Tensor, drafts_by_row: torch.Tensor,
                    cu_num_logits: torch.Tensor, pos: torch.Tensor, idx_mapping: torch.Tensor,
                    idx_mapping_np: np.ndarray, expanded_idx_mapping: torch.Tensor,
                    expanded_local_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule over V2's row layout: request ``r`` owns logits rows
        ``cu[r] .. cu[r+1]-1``; row ``i`` of it predicts the token after draft ``i``
        (the first row follows the last verified token), and ``drafts_by_row[row + 1]``
        is the draft that row verifies (-1: a placeholder, always rejected)."""
        device = processed.device
        num_logits, vocab_size = processed.shape
        cu = self._host_cu_num_logits(cu_num_logits, idx_mapping_np, num_logits)
        num_reqs = cu.numel() - 1
        counts = (cu[1:] - cu[:-1]).tolist()  # K_r + 1 rows per request
        num_drafts = [c - 1 for c in counts]
        k_max = self.num_speculative_steps

        starts = cu[:-1]
        last_rows = (cu[1:] - 1).to(device)
        is_draft_row = torch.ones(num_logits, dtype=torch.bool)
        is_draft_row[cu[1:] - 1] = False
        draft_rows = is_draft_row.nonzero().squeeze(1).to(device)

        max_spec_len = max(num_drafts) if num_drafts else 0
        step = _StepDrafts(
            draft_rows=draft_rows, last_rows=last_rows,
            # One argmax over the rows as they are (a float32 copy has the same argmax):
            # an all-greedy step needs nothing else of the logits.
            row_argmax=processed.argmax(dim=-1),
            # A placeholder (-1: no draft at that slot, e.g. a step starting inside the
            # prefill, or a draft the grammar forbids) goes to the rule as is: every rule
            # rejects an id outside the vocabulary, and the standard rule's residual for
            # it is p itself (algorithms/verify.py), what a non-proposal deserves.
            drafts=drafts_by_row.to(device)[draft_rows + 1].to(torch.int64),
            num_drafts=num_drafts,
            cu_drafts=torch.tensor(np.cumsum(num_drafts), dtype=torch.int64, device=device),
            max_spec_len=max_spec_len)

        sampling = self.sampler.sampling_states
        temperature = sampling.temperature.np[idx_mapping_np]
        sampled_reqs = np.flatnonzero(temperature != 0.0)
        if not sampled_reqs.size:
            # Every request greedy (either rule): the verdict reads only the greedy
            # tokens, so no float32 copy or [T, V] softmax of the logits, no random draws
            # and no device value read back, as V1's specx sampler and vLLM's own do
            # (same output: tests/algorithms/test_verify_rules.py).
            out = verify_greedy(step.drafts, step.cu_drafts, step.row_argmax[draft_rows],
                                step.row_argmax[last_rows], max_spec_len,
                                uniform=all(n == max_spec_len for n in num_drafts))
        else:
            out = self._verify_sampled(step, processed, temperature, sampled_reqs,
                                       idx_mapping_np, pos[starts.to(pos.device)],
                                       expanded_idx_mapping, expanded_local_pos)
        # out: [num_reqs, max_drafts + 1], -1 padded
        sampled = torch.zeros(num_reqs, k_max + 1, dtype=torch.int64, device=device)
        width = min(out.shape[1], k_max + 1)
        sampled[:, :width] = out[:, :width].clamp(min=0)
        num_sampled = (out[:, :width] >= 0).sum(dim=1).to(torch.int32)
        return sampled, num_sampled

    def _verify_sampled(self, step: _StepDrafts, processed: torch.Tensor,
                        temperature: np.ndarray, sampled_reqs: np.ndarray,
                        idx_mapping_np: np.ndarray, first_pos: torch.Tensor,
                        expanded_idx_mapping: torch.Tensor,
                        expanded_local_pos: torch.Tensor) -> torch.Tensor:
        """The method's rule over a step with sampled requests (``sampled_reqs``: their
        rows), on the step's warped logits ``processed``: the backend's ``verify``,
        ``[num_reqs, max_spec_len + 1]``, -1 padded."""
        num_drafts, draft_rows = step.num_drafts, step.draft_rows
        logits32 = processed.to(torch.float32)
        target_logits, bonus_logits = logits32[draft_rows], logits32[step.last_rows]
        device = target_logits.device
        num_reqs, vocab_size = len(num_drafts), target_logits.shape[1]
        is_greedy = torch.from_numpy(temperature == 0.0).to(device)
        # Randomness only for the sampled requests: a greedy request's verdict reads none
        # of it (the greedy rule), and each sampled request draws from its own generator,
        # seeded with (its seed, its first verified position), so leaving the greedy ones
        # out changes no sampled request's draws.
        uniforms = torch.zeros(int(sum(num_drafts)), dtype=torch.float32, device=device)
        exp_noise = torch.ones(num_reqs, vocab_size, dtype=torch.float32, device=device)
        bonus_noise = torch.ones(num_reqs, vocab_size, dtype=torch.float32, device=device)
        seeds = self.sampler.sampling_states.seeds.np[idx_mapping_np]
        positions = first_pos.to("cpu", torch.int64).tolist()
        offsets = np.concatenate([[0], np.cumsum(num_drafts)])
        for r in sampled_reqs.tolist():
            gen = torch.Generator(device=device)
            gen.manual_seed((int(seeds[r]) * _SEED_MIX + positions[r]) % (2**63 - 1))
            n, offset = num_drafts[r], int(offsets[r])
            uniforms[offset: offset + n] = torch.rand(n, generator=gen, device=device)
            self.backend.fill_exp_noise(exp_noise[r], gen)
            self.backend.fill_exp_noise(bonus_noise[r], gen)

        # The bonus (extra) token, drawn here from the last row's warped logits.
        bonus_sampled = (bonus_logits.softmax(dim=-1) / bonus_noise).argmax(dim=-1)
        bonus_tokens = torch.where(is_greedy, step.row_argmax[step.last_rows], bonus_sampled)
        vocab_ids = torch.arange(vocab_size, device=device)
        bonus_probs = (vocab_ids[None, :] == bonus_tokens[:, None]).to(torch.float32)

        full_q, token_q = self._draft_q(draft_rows, expanded_idx_mapping, expanded_local_pos)
        if token_q is None and full_q is None and self.rule == "mtad":
            token_q = torch.ones(draft_rows.numel(), dtype=torch.float32, device=device)
        batch = VerifyBatch(
            rule=self.rule,
            draft_token_ids=step.drafts,
            cu_num_draft_tokens=step.cu_drafts,
            target_probs=target_logits.softmax(dim=-1),
            bonus_probs=bonus_probs,
            is_greedy=is_greedy,
            uniforms=uniforms,
            exp_noise=exp_noise,
            max_spec_len=step.max_spec_len,
            target_argmax=step.row_argmax[draft_rows],
            draft_probs=full_q,
            draft_token_probs=token_q,
            acceptance_threshold=self.acceptance_threshold,
        )
        return self.backend.verify(batch)

    # The step's V2 InputBatch while _verify_in_chunks runs (its host-side layout).
    _input_batch: Any = None

    def _verify_in_chunks(self, logits: torch.Tensor, input_batch: Any, *args: Any,
                          **kwargs: Any) -> Any:
        """V2's, with the step's ``input_batch`` at hand for :meth:`verify_rows`, which
        reads the logits layout from its host copy instead of copying the device one
        back: a read-back waits for the target's forward, and under async scheduling
        that stall is the overlap lost."""
        self._input_batch = input_batch
        try:
            return super()._verify_in_chunks(logits, input_batch, *args, **kwargs)
        finally:
            self._input_batch = None

    def _host_cu_num_logits(self, cu_num_logits: torch.Tensor, idx_mapping_np: np.ndarray,
                            num_logits: int) -> torch.Tensor:
        """This chunk's ``cu_num_logits`` on the host: V2's own ``cu_num_logits_np`` when
        the chunk is the whole batch (every step short of V2's chunk limit), else the
        device tensor read back."""
        batch = self._input_batch
        n = len(idx_mapping_np)
        if batch is not None and batch.num_reqs == n:
            cu_np = np.asarray(batch.cu_num_logits_np[: n + 1], dtype=np.int64)
            if int(cu_np[-1] - cu_np[0]) == num_logits:
                return torch.from_numpy(cu_np - cu_np[0])
        return cu_num_logits.to("cpu", torch.int64)

    def _draft_q(self, draft_rows: torch.Tensor, expanded_idx_mapping: torch.Tensor,
                 expanded_local_pos: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(full q ``[T, V]``, drafted-token q ``[T]``) of this step's drafts from the
        speculator's ``draft_q_by_state`` (:func:`store_draft_q`); (None, None): one-hot."""
        q = getattr(self.speculator, "draft_q_by_state", None)
        if q is None:
            return None, None
        state_rows = expanded_idx_mapping[draft_rows].long()
        depth = expanded_local_pos[draft_rows].long()
        picked = q[state_rows, depth]
        return (picked, None) if q.ndim == 3 else (None, picked)


def install_v2_sampler(runner: Any, settings: dict[str, Any]) -> None:
    """Replace V2's ``runner.rejection_sampler`` by the specx one (after ``load_model``)."""
    from vllm_specx.backends import select_backend

    backend = select_backend()
    runner.rejection_sampler = SpecxV2RejectionSampler(
        runner.sampler, runner.speculative_config, runner.device, settings, backend,
        runner.speculator,
    )
    # Draft trees (glue/v2_tree_step.py): the runner's tree state, None without a tree.
    runner.rejection_sampler.tree_state = getattr(runner, "specx_tree_state", None)
    logger.info("vllm-specx: %s on Model Runner V2 verifies with the specx sampler, rule %r "
                "on the %s backend (%s)", settings["method"], runner.rejection_sampler.rule,
                backend.name, backend.kernel_impl)


def align_eagle3_aux_layers(runner: Any) -> None:
    """Give the target the auxiliary layers an EAGLE-3 head names in ``eagle_config``.

    vLLM 0.32's V2 runner reads ``eagle_aux_hidden_state_layer_ids`` only at the top level
    of the head's config (``eagle3_utils.get_eagle3_aux_layers_from_config``); V1 also
    reads ``eagle_config``, where vLLM-format heads (``vllm-specx distill-eagle3``, the
    test head) keep them. Without this, V2 falls back to the target's default layers and
    the head's ``fc`` reads other layers than it was trained on (or too few of them). Run
    for specx methods only, right after ``load_model`` (before any forward); vLLM's own
    ``eagle3`` is left as vLLM has it."""
    spec_config = runner.speculative_config
    if spec_config is None or spec_config.method != "eagle3":
        return
    hf_config = spec_config.draft_model_config.hf_config
    if getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None):
        return  # V2 read them itself
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if layer_ids:
        runner.model.set_aux_hidden_state_layers(tuple(layer_ids))
        logger.info("vllm-specx: EAGLE-3 auxiliary layers %s from the head's eagle_config "
                    "(Model Runner V2 reads only the top-level key)", tuple(layer_ids))
