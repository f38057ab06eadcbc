#!/usr/bin/env bash
# GPU: a representative part of the model-shape suite (issue 32) in one bounded call (< 9 minutes), kbit against bf16
# cuBLAS, the read ceiling and humming (w2..w5) in the same run, at M = 1, 16, 256, 1024 and k = 2..5.
#
#   Here, once: bash /work/shared/tools/fetch_peer_wheels.sh      (makes .whl/ in the repo root; git ignores it)
#   Device tool: run(command="bash lab/suite/run_suite_part.sh", carry=[".whl"], timeout_s=600)
#
# Shapes (dense, picked from both halves of the suite; kbit bench --suite models --pick): 5120x25600 (Qwen3-32B
# down, held-out), 28672x4096 (Llama-3.1-8B gate_up, tune), 43008x5376 (gemma-3-27b gate_up, held-out), 14336x4096
# (GLM-4.5-Air qkv, tune), 7680x5120 (phi-4 qkv, held-out), 2880x4096 (gpt-oss o, tune). Each shape's peers run right
# after it, and --budget-s stops starting shapes in time, so what comes back holds whole shapes. Written to $OUT:
# suite-<date>.{json,csv,md,png}, suite-<date>-summary.md, run.log. The per-family summary prints last.
set -uo pipefail
# KBIT_COMMIT: the commit the results name (the device copy's git data can be stale); PICK: other shapes of the suite
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/suite-out}
mkdir -p "$OUT"
source lab/suite/peer_env.sh
PICK=${PICK:-5120x25600,28672x4096,43008x5376,14336x4096,7680x5120,2880x4096}
timeout 500 python -m kbit.cli bench ${KBIT_COMMIT:+--commit "$KBIT_COMMIT"} --suite models --suite-parts dense --pick "$PICK" --m 1,16,256,1024 \
  --k 2,3,4,5 --peers humming --budget-s 380 --out "$OUT" --name suite >"$OUT/run.log" 2>&1
rc=$?
# results live in $OUT/<gpu>/; bring them up one level (the device tool returns at most 2 folders down, 8 files)
for f in "$OUT"/*/suite-*; do [ -e "$f" ] && mv "$f" "$OUT/"; done
res=$(ls -t "$OUT"/suite-*.json 2>/dev/null | grep -v summary | head -1)
echo "kbit bench exit $rc; results: ${res:-none}"
tail -n 5 "$OUT/run.log"
if [ -n "$res" ]; then  # the summary from the results file (also when the run was cut short)
  python -m kbit.cli bench --summary "$res" | tee "${res%.json}-summary.md"
fi
