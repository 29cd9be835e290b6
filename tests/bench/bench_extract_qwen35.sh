#!/usr/bin/env bash
# bench_extract_qwen35.sh: bench_extract.sh on a Qwen3.5 hybrid target of the
# same width: dflash-extract against transformers on the CPU (fp32).
BENCH_ARCH=qwen3.5 exec bash "$(dirname "$0")/bench_extract.sh"
