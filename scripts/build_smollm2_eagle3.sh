#!/usr/bin/env bash
# Rebuild the EAGLE-3 head for SmolLM2-135M-Instruct shipped in
# vllm_specx/models/smollm2_eagle3/ with `vllm-specx distill-eagle3`, exactly as committed.
# Run from the repository root after `source scripts/env.sh`.
#
#   bash scripts/build_smollm2_eagle3.sh                 # the committed budget
#   MAX_MINUTES=120 STEPS=2400 bash scripts/build_smollm2_eagle3.sh   # a longer build
#
# Inputs, all offline once the target is cached:
# * the target: `vllm-specx fetch-target`;
# * prompts: the 160 prompts of vllm_specx/prompts/real_distill.jsonl (disjoint from the
#   benchmark's held-out prompts, vllm_specx/prompts/real_heldout.jsonl), answered by the
#   target in vLLM at 4 temperatures x 64 tokens -- the same data stage (and the same
#   work-directory files) as scripts/build_smollm2_draft.sh; 10% of the prompts are held out
#   for REPORT.json;
# * raw text: CORPUS_WINDOWS windows of the Python documentation topics and six standard
#   library packages (as the drafter's build), teacher-forced like the answers.
# Every stage is resumable: an interrupted build continues from the last training
# checkpoint (every 50 steps) when the same command is run again.
# The same head on ten times the data (2,365 prompts): scripts/build_smollm2_eagle3_10x.sh.
set -euo pipefail

WORK=.cache/smol_eagle3
OUT=vllm_specx/models/smollm2_eagle3
STEPS=${STEPS:-900}
MAX_MINUTES=${MAX_MINUTES:-85}
CORPUS_WINDOWS=${CORPUS_WINDOWS:-256}
DRAFT_VOCAB=${DRAFT_VOCAB:-12288}
TARGET=$(vllm-specx fetch-target | tail -n 1)
STDLIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
mkdir -p "$WORK/corpus"
[[ -f "$WORK/corpus/pydoc_topics.txt" ]] || python -c '
import sys
from pydoc_data.topics import topics
with open(sys.argv[1], "w", encoding="utf-8") as f:
    f.write("\n\n".join(topics[k] for k in sorted(topics)))
' "$WORK/corpus/pydoc_topics.txt"

vllm-specx distill-eagle3 --target "$TARGET" \
  --prompts vllm_specx/prompts/real_distill.jsonl \
  --corpus "$WORK/corpus/pydoc_topics.txt" \
  --corpus "$STDLIB/json" --corpus "$STDLIB/email" --corpus "$STDLIB/asyncio" \
  --corpus "$STDLIB/logging" --corpus "$STDLIB/http" --corpus "$STDLIB/collections" \
  --corpus-windows "$CORPUS_WINDOWS" \
  --max-tokens 64 --seq-len 128 --draft-vocab "$DRAFT_VOCAB" \
  --ttt-steps 3 --steps "$STEPS" --batch 8 --lr 1e-3 --max-minutes "$MAX_MINUTES" \
  --eval-every 50 --report-k 1,2,3,4 --report-max-tokens 64 --save-dtype bfloat16 \
  --engine-args '{"kv_cache_memory_bytes": 2147483648, "max_num_seqs": 256, "max_num_batched_tokens": 65536}' \
  --no-progress -o "$OUT" --work-dir "$WORK/work"
