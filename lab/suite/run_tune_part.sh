#!/usr/bin/env bash
# GPU: the config tuner (kbit tune, issue 32) on part of the suite in one bounded call (< 9 minutes): k = 4, M = 1,
# 16, 256, the quick config space, on 3 shapes of the tune half (Llama-3.1-8B gate_up, GLM-4.5-Air qkv, gpt-oss o)
# and 2 of the held-out half (Qwen3-32B down, phi-4 qkv); then (CPU) the default rule fitted on the tune half and
# reported on the held-out half. Each part stops starting entries at its budget and keeps the finished ones.
#
#   Device tool: run(command="bash lab/suite/run_tune_part.sh", timeout_s=600)
#
# Written to $OUT: tuned-tune.json, tuned-held-out.json (every candidate's time per entry), tune.log. The last
# lines printed: the tuned entries (best candidate, its time, the dispatcher's) and the rule's held-out report.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tune-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
common=(--k 4 --m 1,16,256 --quick)
timeout 300 python -m kbit.bench.tune --shapes 28672x4096,14336x4096,2880x4096 --budget-s 230 \
  --out "$OUT/tuned-tune.json" "${common[@]}" >"$OUT/tune.log" 2>&1
timeout 220 python -m kbit.bench.tune --shapes 5120x25600,7680x5120 --budget-s 160 \
  --out "$OUT/tuned-held-out.json" "${common[@]}" >>"$OUT/tune.log" 2>&1
grep -v "^    " "$OUT/tune.log" | tail -n 30
if [ -e "$OUT/tuned-tune.json" ]; then
  python -m kbit.bench.tune --fit "$OUT/tuned-tune.json" --evaluate "$OUT"/tuned-held-out.json
fi
