#!/usr/bin/env bash
# GPU: kbit tune (full config space) at small M, where kbit trails humming on shapes the hand tuning never saw
# (issue 32): k = 2..5, M = 1 and 16, on up to 14 shapes of the suite's tune half, then up to 10 shapes of the
# held-out half; the default rule fitted on the tune half and judged on the held-out half. One bounded call (< 9 min).
#   Device tool: run(command="bash lab/suite/run_tune_small_m.sh", timeout_s=600)
# Written to $OUT: tuned-tune.json (with the fitted rules), tuned-held-out.json, tune.log, fit.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tune-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
common=(--suite models --k 2,3,4,5 --m 1,16)
timeout 300 python -m kbit.bench.tune "${common[@]}" --split tune --max-shapes 14 --budget-s 250 \
  --out "$OUT/tuned-tune.json" >"$OUT/tune.log" 2>&1
timeout 220 python -m kbit.bench.tune "${common[@]}" --split held-out --max-shapes 10 --budget-s 170 \
  --out "$OUT/tuned-held-out.json" >>"$OUT/tune.log" 2>&1
grep -c "candidates in" "$OUT/tune.log"
python -m kbit.bench.tune --fit "$OUT/tuned-tune.json" --evaluate "$OUT/tuned-held-out.json" | tee "$OUT/fit.txt"
