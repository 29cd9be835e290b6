#!/usr/bin/env python3
"""`make fixtures`: run every script that writes tests/fixtures/: the op
references (ops_reference.py, gdn_reference.py), then every
tests/reference/make_*.py (this file excepted) in name order, each in its
own process; stop at the first failure. The op references were left out,
so `make fixtures` did not remake tests/fixtures/ops/."""
import glob
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
ops = [os.path.join(here, n) for n in ("ops_reference.py", "gdn_reference.py")]
scripts = ops + sorted(p for p in glob.glob(os.path.join(here, "make_*.py"))
                       if os.path.basename(p) != "make_fixtures.py")
for s in scripts:
    print(f"== {os.path.relpath(s)}", flush=True)
    rc = subprocess.call([sys.executable, s])
    if rc != 0:
        sys.exit(f"make_fixtures: {os.path.relpath(s)} failed (exit {rc})")
print(f"make_fixtures: {len(scripts)} script(s) done")
