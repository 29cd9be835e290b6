#!/usr/bin/env bash
# bench_extract_moe.sh: bench_extract.sh on a Qwen3-MoE target of the same
# width: dflash-extract against transformers on the CPU (fp32).
BENCH_ARCH=qwen3-moe exec bash "$(dirname "$0")/bench_extract.sh"
