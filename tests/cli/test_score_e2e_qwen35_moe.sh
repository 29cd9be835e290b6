#!/usr/bin/env bash
# slow
# test_score_e2e.sh on a Qwen3.5-MoE target (mktarget --arch qwen3.5
# --experts: Gated DeltaNet and gated attention layers, every MLP a mixture
# of 5 experts, 3 per token, plus the sigmoid-gated shared expert): the
# DeltaNet state restores and the expert routing together, still lossless.
E2E_TARGET="--arch qwen3.5 --full-interval 3 --head-dim 16 --linear-k-heads 2 --linear-v-heads 4 --linear-k-dim 8 \
--linear-v-dim 12 --experts 5 --experts-per-tok 3 --moe-intermediate 24 --shared-intermediate 32" \
    exec bash "$(dirname "$0")/test_score_e2e.sh"
