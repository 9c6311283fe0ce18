"""Which engine should compute `vllm-specx distill-eagle3`'s features on this machine?

The features stage teacher-forces the target over prompt + answer rows and keeps three
auxiliary hidden states per position. This measures, on the real target and in CPU
seconds (robust to other load on a shared machine), the same rows through

* transformers, as the stage runs it: bfloat16 autocast, ``output_hidden_states=True``;
* vLLM's prefill of the same token ids (``max_tokens=1``): a lower bound on what a vLLM
  feature extractor would cost, since it would also have to copy the hidden states out.

Run from the repository root after ``source scripts/env.sh``:

    OMP_NUM_THREADS=1 VLLM_SPECX_CPU_DTYPE=bfloat16 python benchmarks/eagle3_feature_extraction.py

It prints one JSON line (positions per CPU second for each, torch threads, load).
"""

from __future__ import annotations

import json
import os
import time

import torch

ROWS, ROW_TOKENS, BATCH = 64, 128, 8
AUX_LAYERS = (2, 15, 27)  # vLLM's default EAGLE-3 layers for the 30-layer SmolLM2-135M


def main() -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specx import real_pair
    from vllm_specx.engine import make_llm
    from vllm_specx.training.distill import load_causal_lm

    torch.set_num_threads(1)
    target = str(real_pair.ensure_target())
    rows = torch.randint(100, 40000, (ROWS, ROW_TOKENS), generator=torch.Generator().manual_seed(0))
    positions = ROWS * ROW_TOKENS

    model = load_causal_lm(target).eval()
    cpu0 = time.process_time()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(0, ROWS, BATCH):
            out = model(rows[i:i + BATCH], output_hidden_states=True)
            _ = [out.hidden_states[j] for j in AUX_LAYERS]
    transformers_cpu = time.process_time() - cpu0
    del model

    llm = make_llm(target, max_num_seqs=BATCH, max_num_batched_tokens=BATCH * ROW_TOKENS,
                   max_model_len=2 * ROW_TOKENS)
    prompts = [TokensPrompt(prompt_token_ids=r.tolist()) for r in rows]
    once = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompts[:BATCH], once, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()  # the measured rows are prefilled, not found in the cache
    cpu0 = time.process_time()
    llm.generate(prompts, once, use_tqdm=False)
    vllm_cpu = time.process_time() - cpu0

    print(json.dumps({
        "positions": positions,
        "transformers_positions_per_cpu_s": round(positions / transformers_cpu, 1),
        "vllm_prefill_positions_per_cpu_s": round(positions / vllm_cpu, 1),
        "torch_threads": 1, "load": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
