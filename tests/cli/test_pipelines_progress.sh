#!/usr/bin/env bash
# Progress of the long-running tools: extraction, packing, training, scoring.
# Each shows a progress line with its rate on stderr when stderr is a terminal
# (here a pseudo-terminal from script(1)) or with --progress, and stays quiet
# otherwise (pipes, cron: stderr is a file here).
. "$(dirname "$0")/lib.sh"

cd "$T"
tiny_target target --layers 4 --seed 6
awk 'BEGIN { x = 5; for (i = 0; i < 8; i++) { s = ""
      for (j = 0; j < 24; j++) { x = (x * 48271) % 2147483647; s = s (j ? "," : "") x % 60 }
      printf "{\"id\":\"g%d\",\"input_ids\":[%s]}\n", i, s } }' >samples.jsonl
drafter_config drafter.json block=4 target_layers=4 taps="0, 2" layers=1
dflash-extract -m target -l 0,2 -t 1 -o s.dfs samples.jsonl
dflash-train-step --target target --init drafter.json --steps 2 --total-steps 5 --threads 1 --log /dev/null --out ck s.dfs 2>/dev/null

# A progress line: "\rN UNIT  R UNIT/s  Ts" (then ETA and extras when known).
has_progress() { tr '\r' '\n' <"$1" | grep -qE '^[0-9]+ [a-z]+  [0-9.]+ [a-z]+/s  [0-9]+s'; }

# name, then the command with its outputs to files (stdout never a terminal).
declare -A cmds=(
    [dflash-extract]="dflash-extract -m target -l 0,2 -t 1 -o x.dfs samples.jsonl"
    [dflash-pack]="dflash-pack --shuffle -o y.dfs s.dfs"
    [dflash-train-step]="dflash-train-step --target target --resume ck --steps 3 --threads 1 --log /dev/null --out ck2 s.dfs"
)
if command -v dflash-score >/dev/null; then
    cmds[dflash-score]="dflash-score --target target --drafter ck s.dfs >score.tsv"
else
    echo "SKIP dflash-score: progress: dflash-score is not built yet (issue 5)"
fi
for tool in dflash-extract dflash-pack dflash-train-step dflash-score; do
    [ -n "${cmds[$tool]:-}" ] || continue
    cmd=${cmds[$tool]}
    rm -rf x.dfs y.dfs ck2
    bash -c "$cmd" 2>quiet.err >/dev/null
    rc=$?
    if [ $rc = 0 ] && ! has_progress quiet.err && ! grep -q $'\r' quiet.err; then
        pass "$tool: no progress when stderr is not a terminal"
    else
        fail "$tool: no progress when stderr is not a terminal" "rc $rc: $(head -c 200 quiet.err | tr '\r' '|')"
    fi
    rm -rf x.dfs y.dfs ck2
    first=${cmd%% *}; rest=${cmd#* }
    bash -c "$first --progress $rest" 2>forced.err >/dev/null
    has_progress forced.err && pass "$tool --progress: a progress line with a rate" ||
        fail "$tool --progress: a progress line with a rate" "$(head -c 200 forced.err | tr '\r' '|')"
    rm -rf x.dfs y.dfs ck2
    script -qec "$cmd" /dev/null >tty.out 2>&1 </dev/null
    has_progress tty.out && pass "$tool: progress on a terminal without --progress" ||
        fail "$tool: progress on a terminal without --progress" "$(head -c 200 tty.out | tr '\r' '|')"
done
