#!/usr/bin/env bash
# slow
# test_score_e2e.sh on a mixture-of-experts target (mktarget --experts:
# Qwen3MoeForCausalLM, 6 experts, 2 per token, renormalised). The online
# loop's verify forwards route a block's rows through the experts while the
# plain decoding routes one row at a time; routing is per token, so the loop
# must still reproduce greedy decoding token for token, and offline scoring
# at the same anchors must agree cycle for cycle.
E2E_TARGET="--experts 6 --experts-per-tok 2 --moe-intermediate 28" \
    exec bash "$(dirname "$0")/test_score_e2e.sh"
