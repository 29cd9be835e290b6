#!/usr/bin/env bash
# bench_extract_gptoss.sh: bench_extract.sh on a gpt-oss target of the same
# width: dflash-extract against transformers on the CPU (fp32).
BENCH_ARCH=gpt-oss exec bash "$(dirname "$0")/bench_extract.sh"
