"""The specx rejection sampler as vLLM's V1 runner sees it.

:class:`SpecxRejectionSampler` keeps vLLM's ``RejectionSampler`` contract (same
``forward`` arguments, same ``SamplerOutput`` with ``[B, max_spec_len + 1]`` tokens
padded with -1, same logprobs) so the runner's bookkeeping and vLLM's spec-decode
metrics work unchanged. Only the verification rule is ours: it comes from the device
backend chosen in :func:`vllm_specx.backends.select_backend`.

What is reused from vLLM, on purpose, so a request is warped exactly as vLLM warps it
for ordinary sampling: logits processors, penalties, bad words, temperature, top-k and
top-p (``apply_logits_processors`` + ``apply_sampling_constraints``), the per-request
seeded generators (``generate_uniform_probs``, and the per-request exponential noise
drawn from them as vLLM draws it, through the backend: on a CPU a vectorised draw of the
same distribution, ``Backend.fill_exp_noise``), and the bonus token, which vLLM samples
through its full sampler; it is handed to the rule as a one-hot bonus distribution, so it
is never re-sampled.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.rejection_sampler import (
    GREEDY_TEMPERATURE,
    MAX_SPEC_LEN,
    RejectionSampler,
    apply_sampling_constraints,
    generate_uniform_probs,
)

from vllm_specx.algorithms.verify import VerifyBatch, verify_greedy
from vllm_specx.backends.base import Backend
from vllm_specx.methods import METHODS


def verification_rule(settings: dict[str, Any]) -> str:
    """The method's verification rule, as its spec in vllm_specx.methods declares it."""
    return METHODS[settings["method"]].rule


class SpecxRejectionSampler(RejectionSampler):
    """vLLM's rejection sampler with the specx verification rules inside."""

    # A step where no request has drafts is sampled by vLLM's plain sampler (forward);
    # False runs the verification path with zero drafts per row (benchmarks compare).
    plain_sampling_without_drafts: bool = True

    def __init__(self, sampler: Any, spec_config: Any, device: Any,
                 settings: dict[str, Any], backend: Backend) -> None:
        super().__init__(sampler, spec_config, device)
        self.rule = verification_rule(settings)
        # MTAD's tau (validated, default filled in); the standard rule has no threshold.
        self.acceptance_threshold = (
            float(settings["acceptance_threshold"]) if self.rule == "mtad" else 1.0
        )
        self.backend = backend

    def forward(self, metadata: Any, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                sampling_metadata: Any) -> SamplerOutput:
        assert metadata.max_spec_len <= MAX_SPEC_LEN
        if metadata.max_spec_len == 0 and self.plain_sampling_without_drafts:
            # No request of the step has drafts (cost control planned zero for everyone):
            # vLLM's runner still takes the spec-decode path, but there is nothing to
            # verify; one row per request, sampled as a step without speculation samples
            # it (same call, same generator draws, same logprobs), so the step costs a
            # plain decode step's sampling (issue 32, docs/cost-control.md). With one
            # logits row per request the bonus rows are all rows in order (strictly
            # increasing indices into as many rows), so the sampler takes the logits
            # as they are rather than a gathered [B, vocab] copy.
            if logits.shape[0] != metadata.bonus_logits_indices.shape[0]:
                logits = logits[metadata.bonus_logits_indices]
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata)
        # The bonus token: vLLM's own sampler, exactly as in RejectionSampler.forward.
        bonus_logits = logits[metadata.bonus_logits_indices]
        bonus_out = self.sampler(
            logits=bonus_logits,
            sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
            predict_bonus_token=True,
            logprobs_mode_override="processed_logits"
            if self.is_processed_logprobs_mode else "raw_logits",
        )
        bonus_token_ids = bonus_out.sampled_token_ids  # [B, 1]

        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        target_logits = raw_target_logits
        if not self.is_processed_logprobs_mode:
            target_logits = target_logits.clone()
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)
        target_logits = self.apply_constraints(target_logits, metadata, sampling_metadata)
        output_token_ids = self._verify(metadata, draft_probs, target_logits,
                                        bonus_token_ids, sampling_metadata)
        self._verify_trees(metadata, draft_probs, logits, output_token_ids, sampling_metadata)

        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            lp_target, lp_bonus = self._tree_logprob_rows(
                metadata, target_logits if self.is_processed_logprobs_mode
                else raw_target_logits, bonus_out.logprobs_tensors.logprobs)
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs, metadata, logits, lp_target, lp_bonus,
                output_token_ids,
            )
        return SamplerOutput(sampled_token_ids=output_token_ids,
                             logprobs_tensors=logprobs_tensors)

    # Draft trees (glue/tree_step.py): the runner's TreeState when a tree config is on.
    tree_state: Any = None

    def _verify_trees(self, metadata: Any, draft_probs: torch.Tensor | None,
                      logits: torch.Tensor, output_token_ids: torch.Tensor,
                      sampling_metadata: Any) -> None:
        """Re-verify the step's tree requests with the tree rule, in place.

        The chain rule above ran over every request (a tree request's BFS nodes read as
        a chain: its verdict is discarded here). A tree request's ``n + 1`` logits rows
        (vLLM's ``[target rows..., bonus row]``) are exactly the target's distributions
        after the root and after each node's path, which
        :func:`~vllm_specx.algorithms.draft_tree.verify_tree` takes as ``node_probs``; its
        output (accepted path + one token, -1 padded) replaces the request's row, and
        the accepted nodes are left in the step for the KV compaction.
        """
        state = self.tree_state
        step = state.step if state is not None else None
        if step is None:
            return
        from vllm_specx.algorithms.draft_tree import TreeBatch, verify_tree

        num_draft = [int(n) for n in metadata.num_draft_tokens]
        device = logits.device
        # Rows of request r in `logits` (and of its q in the 1-D draft_probs).
        row_start = np.concatenate([[0], np.cumsum([n + 1 for n in num_draft])])
        q_start = np.concatenate([[0], np.cumsum(num_draft)])
        trees = step.trees
        rows = torch.cat([torch.arange(int(row_start[t.row]), int(row_start[t.row + 1]))
                          for t in trees]).to(device)
        node_logits = logits[rows].to(torch.float32)
        target_argmax = node_logits.argmax(dim=-1)
        if sampling_metadata.all_greedy:
            # The greedy walk reads only the argmax; verify_tree checks the rows' shape.
            node_probs = node_logits
        else:
            # Warped as vLLM warps the chain's rows (temperature, top-k, top-p), over the
            # whole step's layout so each row meets its own request's settings.
            cu_rows = torch.tensor(row_start[1:], dtype=torch.int64, device=device)
            warped = apply_sampling_constraints(logits.to(torch.float32).clone(), cu_rows,
                                                sampling_metadata)
            node_probs = warped[rows].softmax(dim=-1, dtype=torch.float32)
        tree_rows = torch.tensor([t.row for t in trees], device=device)
        if sampling_metadata.all_greedy:
            is_greedy = torch.ones(len(trees), dtype=torch.bool, device=device)
        else:
            is_greedy = (sampling_metadata.temperature == GREEDY_TEMPERATURE)[tree_rows]
        exp_noise = torch.empty(len(trees), node_probs.shape[1], dtype=torch.float32,
                                device=device)
        self.backend.fill_exp_noise(exp_noise, None)
        for i, tree in enumerate(trees):
            generator = sampling_metadata.generators.get(tree.row)
            if generator is not None:
                self.backend.fill_exp_noise(exp_noise[i], generator)
        q = q_rows = None
        if draft_probs is not None and draft_probs.ndim == 1:
            q = torch.cat([draft_probs[int(q_start[t.row]): int(q_start[t.row + 1])]
                           for t in trees]).to(torch.float32)
        elif self.rule == "mtad":
            q = torch.ones(int(sum(num_draft[t.row] for t in trees)), device=device)
        elif (draft_probs is not None and draft_probs.ndim == 2
              and draft_probs.shape[1] == node_probs.shape[1]):
            # A draft-model tree with i.i.d. children (glue/sampled_tree_round.py): each
            # node's row is the q its parent's children were drawn from.
            q_rows = torch.cat([draft_probs[int(q_start[t.row]): int(q_start[t.row + 1])]
                                for t in trees]).to(torch.float32)
        batch = TreeBatch(
            token_ids=torch.cat([t.tokens for t in trees]).to(device),
            parents=torch.cat([t.parents for t in trees]).to(device),
            cu_num_nodes=torch.tensor(np.cumsum([t.parents.shape[0] for t in trees]),
                                      dtype=torch.int64, device=device),
        )
        # The lossless rule for a draft-model tree: "sampled" (SpecInfer) when the
        # drafter handed the q rows its i.i.d. children were drawn from; otherwise
        # "deterministic": its children were chosen without the verifier's randomness
        # (top-k / drawn without replacement by the drafter), and it reads no q.
        tree_rule = {"mtad": "mtad", "standard": "deterministic"}.get(self.rule)
        if q_rows is not None and tree_rule == "deterministic":
            tree_rule = "sampled"
        if tree_rule is None:
            raise NotImplementedError(
                f"vllm-specx: tree verification with the {self.rule!r} rule is not wired yet")
        # One uniform per node (MTAD's test reads none), seeded rows from their generator.
        uniforms = torch.rand(batch.num_nodes, device=device)
        start = 0
        for tree in trees:
            n = tree.parents.shape[0]
            generator = sampling_metadata.generators.get(tree.row)
            if generator is not None:
                uniforms[start: start + n] = torch.rand(n, generator=generator, device=device)
            start += n
        verdict = verify_tree(
            batch, node_probs, rule=tree_rule, is_greedy=is_greedy, exp_noise=exp_noise,
            uniforms=uniforms,
            target_argmax=target_argmax, draft_token_probs=q, draft_probs=q_rows,
            acceptance_threshold=self.acceptance_threshold,
            all_greedy=bool(sampling_metadata.all_greedy),
        )
        accepted = verdict.num_accepted.tolist()
        for i, tree in enumerate(trees):
            a = int(accepted[i])
            output_token_ids[tree.row] = -1
            output_token_ids[tree.row, : a + 1] = verdict.output_token_ids[i, : a + 1].to(
                output_token_ids.dtype)
            step.accepted[tree.row] = verdict.accepted_nodes[i, :a].tolist()

    def _tree_logprob_rows(self, metadata: Any, target_rows: torch.Tensor,
                           bonus_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows vLLM's logprobs computation reads, reordered for tree requests.

        vLLM takes the logprobs of a request's j-th output token from its j-th row
        (chain layout). A tree request's j-th accepted token was verified on its parent's
        row: the root's for j = 0, node ``path[j - 1]``'s after that (the extra token
        too). The step's rows are laid out as vLLM does (target rows at
        ``target_logits_indices``, bonus rows at ``bonus_logits_indices``), permuted per
        tree request, and split back."""
        state = self.tree_state
        step = state.step if state is not None else None
        if step is None or not step.accepted:
            return target_rows, bonus_rows
        t_idx, b_idx = metadata.target_logits_indices, metadata.bonus_logits_indices
        num_rows = int(t_idx.shape[0] + b_idx.shape[0])
        full = target_rows.new_zeros(num_rows, target_rows.shape[1], dtype=torch.float32)
        full[t_idx] = target_rows.to(torch.float32)
        full[b_idx] = bonus_rows.to(torch.float32)
        perm = torch.arange(num_rows, device=full.device)
        row_start = np.concatenate([[0], np.cumsum([int(n) + 1 for n in
                                                    metadata.num_draft_tokens])])
        for tree in step.trees:
            path = step.accepted.get(tree.row, [])
            first = int(row_start[tree.row])
            src = torch.tensor([0] + [1 + n for n in path], device=full.device) + first
            perm[first: first + len(path) + 1] = src
        full = full[perm]
        return full[t_idx], full[b_idx]

    def apply_constraints(self, target_logits: torch.Tensor, metadata: Any,
                          sampling_metadata: Any) -> torch.Tensor:
        """Temperature, top-k and top-p on the [T, V] target logits, as vLLM's
        ``RejectionSampler`` applies them (the subclass for vLLM-Ascend's runner applies
        vLLM-Ascend's instead: vllm_specx/glue/ascend.py)."""
        if target_logits.shape[0] == 0:
            # vLLM 0.32's top-k path takes k.max() of the per-token k and crashes on a step
            # where no request drafted; with nothing to warp there is nothing to do.
            return target_logits
        return apply_sampling_constraints(
            target_logits, metadata.cu_num_draft_tokens, sampling_metadata
        )

    def _verify(self, metadata: Any, draft_probs: torch.Tensor | None,
                target_logits: torch.Tensor, bonus_token_ids: torch.Tensor,
                sampling_metadata: Any) -> torch.Tensor:
        """Build the batch from vLLM's step and run the backend's verify.

        ``target_logits``: [T, V] float32 after logits processors and sampling
        constraints, the very tensor vLLM's ``rejection_sample`` takes its greedy argmax
        of. The greedy token is taken here from those logits, as vLLM does, not from
        the probabilities: two logits closer than float32 softmax resolution become
        equal probabilities, whose argmax would be the lower index where vLLM's is the
        other, and a greedy request would then differ from no speculation.
        """
        target_argmax = target_logits.argmax(dim=-1)
        if sampling_metadata.all_greedy:
            # Every request greedy (either rule): the verdict reads only the greedy
            # tokens, so skip the [T, V] softmax, the [B, V] one-hot bonus rows and the
            # random draws, as vLLM's sampler does for an all-greedy step (same output:
            # tests/algorithms/test_verify_rules.py).
            # Every request with exactly max_spec_len drafts (a fixed-K step; the counts
            # are a host list): the [B, K] shortcut, a fraction of the ops (kernel
            # launches on a GPU) of the ragged layout.
            k = metadata.max_spec_len
            uniform = all(n == k for n in metadata.num_draft_tokens)
            return verify_greedy(metadata.draft_token_ids, metadata.cu_num_draft_tokens,
                                 target_argmax, bonus_token_ids, k,
                                 uniform=uniform).to(torch.int32)
        num_draft_tokens: list[int] = list(metadata.num_draft_tokens)
        batch_size = len(num_draft_tokens)
        num_tokens, vocab_size = target_logits.shape
        device = target_logits.device
        target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)

        if sampling_metadata.all_greedy:
            is_greedy = torch.ones(batch_size, dtype=torch.bool, device=device)
        else:
            is_greedy = sampling_metadata.temperature == GREEDY_TEMPERATURE
        # vLLM's own bonus token (its full sampler, greedy included) as a one-hot row,
        # so the rule emits exactly that token after a full accept.
        # Built by comparison, not scatter: the npu backend's device op list has no
        # scatter (tests/ascend/test_npu_device_ops.py).
        vocab_ids = torch.arange(vocab_size, device=device)
        bonus_probs = (vocab_ids[None, :] == bonus_token_ids.view(-1, 1).long()).to(torch.float32)

        # Randomness drawn exactly as vLLM draws it (seeded generators honoured, and no
        # draws for requests without drafts, which keeps seeded runs reproducible).
        uniforms = generate_uniform_probs(num_tokens, num_draft_tokens,
                                          sampling_metadata.generators, device)
        # Exp(1) through the backend (a vectorised draw on a CPU: Backend.fill_exp_noise).
        exp_noise = torch.empty(batch_size, vocab_size, dtype=torch.float32, device=device)
        self.backend.fill_exp_noise(exp_noise, None)
        for i, generator in sampling_metadata.generators.items():
            if num_draft_tokens[i] > 0:
                self.backend.fill_exp_noise(exp_noise[i], generator)

        full_q = token_q = None
        if draft_probs is None and self.rule == "mtad":
            # The runner lost the cached draft probabilities (it logs a warning): treat
            # q as 1 rather than fail the step; the rule then thresholds on p alone.
            token_q = torch.ones(num_tokens, dtype=torch.float32, device=device)
        elif draft_probs is not None:
            if draft_probs.ndim == 1:
                token_q = draft_probs.to(torch.float32)
            else:
                full_q = draft_probs.to(torch.float32)
        batch = VerifyBatch(
            rule=self.rule,
            draft_token_ids=metadata.draft_token_ids,
            cu_num_draft_tokens=metadata.cu_num_draft_tokens,
            target_probs=target_probs,
            bonus_probs=bonus_probs,
            is_greedy=is_greedy,
            uniforms=uniforms,
            exp_noise=exp_noise,
            max_spec_len=metadata.max_spec_len,
            target_argmax=target_argmax,
            draft_probs=full_q,
            draft_token_probs=token_q,
            acceptance_threshold=self.acceptance_threshold,
        )
        return self.backend.verify(batch).to(torch.int32)  # sampled_token_ids is int32
