#!/usr/bin/env bash
# Build an EAGLE-3 head for SmolLM2-135M-Instruct on ten times the data of the shipped one
# (issue 33): the 2,365 prompts of vllm_specx/prompts/eagle3_train.jsonl (built by
# scripts/build_eagle3_prompts.py; provenance in docs/training/distill-eagle3.md), held out
# on exactly the 16 prompts the shipped head's REPORT was measured on
# (vllm_specx/prompts/eagle3_heldout.jsonl, never trained on). Run from the repository root
# after `source scripts/env.sh`.
#
#   bash scripts/build_smollm2_eagle3_10x.sh                      # into .cache/smol_eagle3_10x/head
#   OUT=vllm_specx/models/smollm2_eagle3 bash scripts/build_smollm2_eagle3_10x.sh   # to ship it
#   DEVICE=cuda BATCH=64 STEPS=1200 bash scripts/build_smollm2_eagle3_10x.sh        # on a GPU
#
# Every stage resumes: run the same command again after a kill or a budget stop. The data
# stage (the target answering every prompt at 4 temperatures in vLLM's CPU engine) keeps
# shards of DATA_SHARD prompts, the features stage shards of FEATURE_SHARD rows, training a
# checkpoint every 50 steps. MAX_MINUTES is the training budget counted over all sittings:
# raise it to continue a run its budget stopped (e.g. 150, then 300, ...).
#
# Estimated on this 2-core machine from the shipped head's REPORT.json (load 7-14): data
# ~3.7 h (45 generated tokens/s, ~590 k tokens), features ~80 min (234 positions/s, ~1.1 M
# positions, ~5 GB in the work directory), training ~10.2 k positions/min, so the default
# 9,000 steps x 8 rows (~7.5 M positions, 10x the shipped head's) ~12 h. Not measured on a
# GPU: none was lent to the session that wrote this.
set -euo pipefail

WORK=.cache/smol_eagle3_10x
OUT=${OUT:-$WORK/head}
STEPS=${STEPS:-9000}
BATCH=${BATCH:-8}
MAX_MINUTES=${MAX_MINUTES:-150}
CORPUS_WINDOWS=${CORPUS_WINDOWS:-1024}
DRAFT_VOCAB=${DRAFT_VOCAB:-12288}
DEVICE=${DEVICE:-auto}
DATA_SHARD=${DATA_SHARD:-128}
FEATURE_SHARD=${FEATURE_SHARD:-2048}
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
  --prompts vllm_specx/prompts/eagle3_train.jsonl \
  --heldout-prompts vllm_specx/prompts/eagle3_heldout.jsonl \
  --data-shard-prompts "$DATA_SHARD" --feature-shard-rows "$FEATURE_SHARD" \
  --corpus "$WORK/corpus/pydoc_topics.txt" \
  --corpus "$STDLIB/json" --corpus "$STDLIB/email" --corpus "$STDLIB/asyncio" \
  --corpus "$STDLIB/logging" --corpus "$STDLIB/http" --corpus "$STDLIB/collections" \
  --corpus-windows "$CORPUS_WINDOWS" \
  --max-tokens 64 --seq-len 128 --draft-vocab "$DRAFT_VOCAB" \
  --ttt-steps 3 --steps "$STEPS" --batch "$BATCH" --lr 1e-3 --max-minutes "$MAX_MINUTES" \
  --eval-every 50 --report-k 1,2,3,4 --report-max-tokens 64 --save-dtype bfloat16 \
  --device "$DEVICE" \
  --engine-args '{"kv_cache_memory_bytes": 2147483648, "max_num_seqs": 256, "max_num_batched_tokens": 65536}' \
  --no-progress -o "$OUT" --work-dir "$WORK/work"
