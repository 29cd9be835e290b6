#!/usr/bin/env python3
"""The transformers side of bench_extract.sh: the same extraction with
PyTorch on the CPU in fp32 (what one runs without dflash).

  bench_extract.py MODEL_DIR INPUT.jsonl THREADS LAYER_IDS

Loads the model once in float32 with the default attention (sdpa) and runs
two loops over the samples, each sample alone (batch 1), gathering
hidden_states[k+1] for the tapped ids, concatenated and rounded to bf16
(the work the stream stores):
  causal_lm  AutoModelForCausalLM(...)(ids, output_hidden_states=True), as
             the EAGLE data-generation scripts and other HF-based
             extractors call it (logits computed too);
  base       its decoder alone (model.model), no LM head: the lean way.
Prints one line: "tokens N load_s X causal_lm_s Y base_s Z".
"""
import json
import sys
import time

t0 = time.time()
import torch
import transformers

model_dir, inp, threads, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
ids = [int(x) for x in layers.split(",")]
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
model.eval()
samples = [json.loads(line)["input_ids"] for line in open(inp) if line.strip()]
t1 = time.time()


def run(m):
    tokens = 0
    start = time.time()
    with torch.inference_mode():
        for s in samples:
            hs = m(input_ids=torch.tensor([s]), output_hidden_states=True).hidden_states
            feat = torch.cat([hs[k + 1][0] for k in ids], dim=-1).to(torch.bfloat16)
            tokens += feat.shape[0]
    return tokens, time.time() - start


tokens, causal_s = run(model)
_, base_s = run(model.model)
print(f"tokens {tokens} load_s {t1 - t0:.3f} causal_lm_s {causal_s:.3f} base_s {base_s:.3f}")
