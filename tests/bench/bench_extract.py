#!/usr/bin/env python3
"""The transformers side of bench_extract.sh: the same extraction with
PyTorch on the CPU in fp32 (what a user without dflash would run).

  bench_extract.py MODEL_DIR INPUT.jsonl THREADS LAYER_IDS

Loads the base model (no LM head: dflash-extract does not run it either)
in float32 with the default attention (sdpa), runs each sample alone with
output_hidden_states=True, gathers hidden_states[k+1] for the tapped ids,
concatenates them and rounds to bf16 (the work the stream stores). Prints
one line: "torch_tokens N load_s X loop_s Y".
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
model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
model.eval()
samples = [json.loads(line)["input_ids"] for line in open(inp) if line.strip()]
t1 = time.time()
tokens = 0
with torch.inference_mode():
    for s in samples:
        out = model(input_ids=torch.tensor([s]), output_hidden_states=True)
        hs = out.hidden_states
        feat = torch.cat([hs[k + 1][0] for k in ids], dim=-1).to(torch.bfloat16)
        tokens += feat.shape[0]
t2 = time.time()
print(f"torch_tokens {tokens} load_s {t1 - t0:.3f} loop_s {t2 - t1:.3f}")
