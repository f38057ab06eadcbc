#!/bin/bash
# One device call: the README's end-to-end table at the working tree (bench_e2e as e2e-h100-2026-11-27c ran it), after
# the attention's merge rule and one-round second launch. Logs and tables: $OUT/e2e-refresh.tgz, packed after each stage.
set -u
# the device copy's git metadata may name an older commit: say which one is under test
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
export KBIT_COMMIT
export PYTHONUNBUFFERED=1
O=/tmp/e2e-refresh
mkdir -p "$O"
pack() { tar czf "${OUT:-.}/e2e-refresh.tgz" -C "$O" . ; }
D=${DATE:-$(date +%F)}
echo "== dense"
PYTHONPATH=$PWD/src timeout ${T_DENSE:-330} python benchmarks/bench_e2e.py --models llama3-8b,qwen3-8b,qwen2.5-7b --k 4,2 \
  --batch 1,4,16 --steps 16 --reps 3 --fuse-proj --no-kr --eager-steps 0 --out "$O" --name "e2e-h100-$D" \
  > "$O/dense.log" 2>&1
echo "rc $?"; grep -A12 '^```' "$O/e2e-h100-$D.md" | head -n 20
pack
echo "== moe"
PYTHONPATH=$PWD/src timeout ${T_MOE:-120} python benchmarks/bench_e2e.py --models qwen3-30b-a3b --k 4 --batch 1,16 \
  --steps 16 --reps 3 --fuse-proj --no-kr --eager-steps 0 --out "$O" --name "e2e-h100-$D-moe" > "$O/moe.log" 2>&1
echo "rc $?"; grep -A6 '^```' "$O/e2e-h100-$D-moe.md" | head -n 8
pack
