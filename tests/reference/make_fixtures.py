#!/usr/bin/env python3
"""`make fixtures`: run every tests/reference/make_*.py (this file excepted),
in name order, each in its own process; stop at the first failure."""
import glob
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
scripts = sorted(p for p in glob.glob(os.path.join(here, "make_*.py"))
                 if os.path.basename(p) != "make_fixtures.py")
for s in scripts:
    print(f"== {os.path.relpath(s)}", flush=True)
    rc = subprocess.call([sys.executable, s])
    if rc != 0:
        sys.exit(f"make_fixtures: {os.path.relpath(s)} failed (exit {rc})")
print(f"make_fixtures: {len(scripts)} script(s) done")
