#!/usr/bin/env bash
# GPU (optional, after run_tune_suite.sh): the tuned table judged on held-out shapes against every candidate of the
# quick space (not only the candidates kbit bench times), in one bounded call (< 9.5 minutes of wall time): kbit tune
# on the suite's held-out half (shapes the tune half does not have, N x K bands in turn), k = 4 (then 2), M = 1, 16,
# 256, 1024, with the table installed, so that each entry's "dispatcher" time is the dispatcher's choice from the
# table (its fitted rules, on these unseen shapes); then (CPU) the rules refitted on the tune table, judged on these.
#
#   Device tool: run(command="bash lab/suite/run_heldout_tune.sh", timeout_s=600)
#
# KS, MS, BUDGET_S: the bits, M buckets and budget (default 4,2; 1,16,256,1024; 470 s).
# The table: as lab/suite/run_heldout_eval.sh finds it (/tmp/kbit-tune of the warm machine, else packaged). Written
# to $OUT: tuned-held-out.json, heldout-tune.log, fit.txt. Printed last: the entries (best, dispatcher, their ratio)
# and the "dispatcher / best candidate" line.
set -uo pipefail
# KBIT_COMMIT: the commit the results name (the device copy's git data can be stale)
cd "$(dirname "$0")/../.."
T0=$(date +%s)
OUT=${OUT:-/tmp/heldout-tune-out}
STATE=/tmp/kbit-tune
mkdir -p "$OUT" "$STATE/cubin"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KBIT_CACHE_DIR="$STATE/cubin"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null || true
gpu=$(python -c "import torch; from kbit.tuning.tables import gpu_key; print(gpu_key(torch.device('cuda')))")
if [ -e "$STATE/tuned-$gpu.json" ]; then  # the user's table wins over a packaged one
  mkdir -p "$KBIT_CACHE_DIR/tuned" && cp "$STATE/tuned-$gpu.json" "$KBIT_CACHE_DIR/tuned/$gpu.json"
  echo "table: $STATE/tuned-$gpu.json (this machine's run_tune_suite.sh) installed as $KBIT_CACHE_DIR/tuned/$gpu.json"
elif [ -e "src/kbit/tuning/configs/tuned-$gpu.json" ]; then
  echo "table: packaged src/kbit/tuning/configs/tuned-$gpu.json"
else
  echo "table: NONE for $gpu (the dispatcher uses its built-in rules)"
fi
timeout 540 python -m kbit.bench.tune ${KBIT_COMMIT:+--commit "$KBIT_COMMIT"} --suite models --split held-out --order bands --quick --k "${KS:-4,2}" \
  --m "${MS:-1,16,256,1024}" --budget-s "${BUDGET_S:-470}" --out "$STATE/tuned-held-out.json" >"$OUT/heldout-tune.log" 2>&1
echo "kbit tune exit $? after $(( $(date +%s) - T0 )) s"
[ -e "$STATE/tuned-held-out.json" ] && cp "$STATE/tuned-held-out.json" "$OUT/"
if [ -e "$STATE/tuned-tune.json" ] && [ -e "$STATE/tuned-held-out.json" ]; then
  cp "$STATE/tuned-tune.json" /tmp/tuned-tune-refit.json
  python -m kbit.bench.tune --fit /tmp/tuned-tune-refit.json --evaluate "$STATE/tuned-held-out.json" >"$OUT/fit.txt" 2>&1
fi
grep -E "^prebuild|not stored|^budget" "$OUT/heldout-tune.log" | tail -n 6
grep -E "^\| |^dispatcher" "$OUT/heldout-tune.log" | tail -n 40
cat "$OUT/fit.txt" 2>/dev/null
echo "wall $(( $(date +%s) - T0 )) s"
