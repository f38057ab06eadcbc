#!/usr/bin/env bash
# GPU: kbit tune (issue 32) over the suite's tune half in one bounded call (< 9.5 minutes of wall time): the quick
# space, k = 2, 3, 4, 5, M = 1, 16, 256, 1024, shapes ordered so that the first ones cover every N x K band of the
# fitted rule and the model families in turn (--order bands), the CUDA kernels compiled ahead by the other CPU
# cores (--build-workers); then (CPU) the default rule fitted on what finished and the table packaged for shipping.
#
#   Device tool: run(command="bash lab/suite/run_tune_suite.sh", timeout_s=600)
#
# MS: the M buckets to tune (default 1,16,256,1024). SEED: a tuned table in the tree (e.g. an earlier call's
# tuned-tune.json, copied into an untracked folder) that a fresh machine starts from: its entries are kept and skipped.
# A second call on the same warm machine goes on where the first stopped (the table and the CUBIN cache stay in
# /tmp/kbit-tune there; the table's name holds a digest of the tuner's code, so a changed tuner starts afresh):
# entries already tuned are skipped. Written to $OUT: tuned-tune.json (every candidate's
# time per entry, with the fitted rules), tuned-<gpu>.json (the packaged form: copy it to
# src/kbit/tuning/configs/), tune.log, fit.txt. Printed last: the tuned entries and the rule's report.
set -uo pipefail
# KBIT_COMMIT: the commit the results name (the device copy's git data can be stale)
cd "$(dirname "$0")/../.."
T0=$(date +%s)
OUT=${OUT:-/tmp/tune-out}
STATE=/tmp/kbit-tune
mkdir -p "$OUT" "$STATE"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KBIT_CACHE_DIR="$STATE/cubin"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null || true
# 600 s limit: ~15 s to start python, the budget stops starting candidates at 470 s, one candidate may run past it
code=$(cat src/kbit/bench/tune.py src/kbit/tuning/*.py | md5sum | cut -c1-8)
TABLE="$STATE/tuned-tune-$code.json"
if [ -n "${SEED:-}" ] && [ ! -e "$TABLE" ]; then cp "$SEED" "$TABLE" && echo "seeded from $SEED"; fi
echo "table: $TABLE ($( [ -e "$TABLE" ] && echo "continued" || echo "new"))"
timeout 540 python -m kbit.bench.tune ${KBIT_COMMIT:+--commit "$KBIT_COMMIT"} --suite models --split tune --order bands --quick --k 2,3,4,5 \
  --m "${MS:-1,16,256,1024}" --budget-s "${BUDGET_S:-470}" --out "$TABLE" >>"$STATE/tune-$code.log" 2>&1
echo "kbit tune exit $? after $(( $(date +%s) - T0 )) s"
cp "$STATE/tune-$code.log" "$OUT/tune.log"
if [ -e "$TABLE" ]; then
  gpu=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['gpu'])" "$TABLE")
  python -m kbit.bench.tune --fit "$TABLE" --package "$STATE/tuned-$gpu.json" >"$OUT/fit.txt" 2>&1
  cp "$TABLE" "$OUT/tuned-tune.json" && cp "$TABLE" "$STATE/tuned-tune.json" && cp "$STATE/tuned-$gpu.json" "$OUT/"
fi
grep -E "^prebuild|candidates in|not stored|^budget" "$OUT/tune.log" | tail -n 12
grep -E "^\| |^dispatcher" "$OUT/tune.log" | tail -n 40
cat "$OUT/fit.txt" 2>/dev/null
echo "wall $(( $(date +%s) - T0 )) s"
