#!/usr/bin/env bash
# slow
# test_score_e2e.sh on a Qwen3.5 hybrid target (mktarget --arch qwen3.5: two
# Gated DeltaNet layers before each gated attention layer). A trained
# drafter gets blocks accepted in part, so the online loop restores the
# DeltaNet state and convolution history from the middle of verify forwards
# all the time; it must still reproduce greedy decoding token for token, and
# offline scoring at the same anchors must agree cycle for cycle.
E2E_TARGET="--arch qwen3.5 --full-interval 3 --head-dim 16 --linear-k-heads 2 --linear-v-heads 4 --linear-k-dim 8 --linear-v-dim 12" \
    exec bash "$(dirname "$0")/test_score_e2e.sh"
