#!/usr/bin/env bash
# The main job: set-up (first run only), then `vllm-specx bench` with its defaults: the
# real vLLM engine on the platform present, the fixture target/draft pair, no speculation
# vs vLLM's ngram and draft_model vs every available specx method. Extra args go to
# `vllm-specx bench` (see `vllm-specx bench --help`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec vllm-specx bench "$@"
