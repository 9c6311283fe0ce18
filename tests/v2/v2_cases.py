"""Models, prompts and engine settings shared by the V2 tests (``from v2_cases import ...``)."""

from __future__ import annotations

from typing import Any

from vllm_specx.fixtures import fixtures_root

TARGET = str(fixtures_root() / "target")
DRAFT = str(fixtures_root() / "draft")
MTP_TARGET = str(fixtures_root() / "mtp_target")
ACCEPTANCE_HEAD = str(fixtures_root() / "head")

ENGINE_KWARGS: dict[str, Any] = {
    "max_num_batched_tokens": 64,
    "enable_prefix_caching": True,
    "disable_log_stats": False,  # spec-decode counters
}

# Ragged prompt lengths (one past the 64-token chunk: chunked prefill), short outputs.
PROMPTS: list[list[int]] = [
    [(7 * i + 3) % 500 + 10 for i in range(n)] for n in (5, 17, 70)
]
MAX_TOKENS = 12
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def heldout_prompts() -> list[list[int]]:
    """Four held-out code prompts (token ids, ragged lengths) on which the test EAGLE-3
    head's drafts are accepted (on PROMPTS none are): the head-tree tests' requests."""
    from transformers import AutoTokenizer

    from vllm_specx.fixtures import heldout_prompts as texts

    tok = AutoTokenizer.from_pretrained(TARGET)
    enc = [tok(t)["input_ids"] for t in texts(4)]
    return [enc[0][:5], enc[1][:33], enc[2][:48], enc[3][:17]]


def build_eagle3_head(out_dir: str) -> str:
    """The test EAGLE-3 head (``scripts/build_eagle3_fixture.py``, as tests/eagle builds
    it). Its auxiliary layer ids are in ``eagle_config`` only, which vLLM 0.32's V2 runner
    does not read (V1 does): for specx_eagle3 the plugin hands them to the target after
    ``load_model`` (``glue/v2_sampler.align_eagle3_aux_layers``); without that V2 would
    use this 4-layer target's defaults, (2, 2, 1): two auxiliary states for an ``fc``
    over three, which fails in the engine."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "build_eagle3_fixture.py"
    spec = importlib.util.spec_from_file_location("build_eagle3_fixture", script)
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    return str(builder.build(Path(out_dir)))


# Structured outputs on V2: each of PROMPTS (token ids; the grammar needs the fixture's
# tokenizer) under each of engine_requests.STRUCTURED_KINDS.
STRUCTURED_MAX_TOKENS = 16


def install_grammar_bitmask_stand_in() -> None:
    """Runs in the V2 host. V2 masks the logits of a request with a structured output by
    a Triton kernel (``vllm/v1/worker/gpu/structured_outputs.py``,
    ``_apply_grammar_bitmask_kernel``) that the Triton interpreter cannot run on a CPU
    (its store mask is refused: ``mask has unsupported dtype``, without speculation too).
    This puts the same arithmetic, in torch, where ``apply_grammar_bitmask`` launches it
    (``kernel[grid](...)``): bitmask row ``i`` masks logits row ``cu_num_logits[r] + p``
    (``logits_indices[i] = r * MASK_STRIDE + p``) where its bit is 0, if request ``r``
    has a logit at position ``p`` in this step. Everything else of V2's structured
    outputs (xgrammar, the scheduler's draft checks, the row mapping) is vLLM's own."""
    import torch
    from vllm.v1.worker.gpu import structured_outputs

    class GrammarBitmask:
        def __getitem__(self, grid: tuple[int, int]) -> Any:
            def apply(logits: torch.Tensor, logits_stride: int, logits_indices: torch.Tensor,
                      cu_num_logits: torch.Tensor, bitmask: torch.Tensor, bitmask_stride: int,
                      vocab_size: int, MASK_STRIDE: int, BLOCK_SIZE: int) -> None:
                cu = cu_num_logits.to("cpu", torch.int64).tolist()
                shifts = torch.arange(32, dtype=torch.int32)
                for i, index in enumerate(logits_indices[:grid[0]].tolist()):
                    req, pos = divmod(int(index), MASK_STRIDE)
                    if pos >= cu[req + 1] - cu[req]:
                        continue
                    packed = bitmask[i, :bitmask_stride].to("cpu", torch.int32)
                    banned = (((packed[:, None] >> shifts[None, :]) & 1) == 0).reshape(-1)
                    row = logits[cu[req] + pos, :vocab_size]
                    row[banned[:vocab_size].to(row.device)] = -float("inf")
            return apply

    structured_outputs._apply_grammar_bitmask_kernel = GrammarBitmask()


def generate_structured(llm: Any, max_tokens: int) -> list[list[int]]:
    """Runs in the V2 host: each of :data:`PROMPTS` under each of
    ``engine_requests.STRUCTURED_KINDS``, greedy, one batch; token ids in that order."""
    from engine_requests import STRUCTURED_KINDS, structured

    install_grammar_bitmask_stand_in()
    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS for _ in STRUCTURED_KINDS]
    kinds = [kind for _ in PROMPTS for kind in STRUCTURED_KINDS]
    outputs = llm.generate(prompts, structured(kinds, max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]
