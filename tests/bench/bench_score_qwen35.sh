#!/usr/bin/env bash
# bench_score_qwen35.sh: bench_score.sh on a Qwen3.5 hybrid target of the same
# width: the online speculative loop against plain greedy decoding, CPU.
BENCH_ARCH=qwen3.5 exec bash "$(dirname "$0")/bench_score.sh"
