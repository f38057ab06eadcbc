#!/bin/bash
# One device call: the grouped kernels read the block count after their PDL wait (ld_dep) against the tree before,
# where ptxas had moved it above the wait in some builds (tests/pdl_scan.py). Needs the base tree under .ab/base
# (carry ".ab"):   mkdir -p .ab/base && git archive <base> src | tar -x -C .ab/base
# (ORDER may name other trees under .ab; lab/patches/moe-prefetch-down.patch on the base made the "pf" tree.)
# 1. the decode step, new / base / new / base, a fresh process a run (bench_e2e, MODELS, LAYERS, BATCH);
# 2. GPU tests: tests/test_pdl_order.py, then the grouped, MoE and decode tests;
# 3. lab/pdl_hoist_scan.py --quick with this machine's NVRTC.
# Logs and tables: $OUT/pdl-order-ab.tgz, packed after each stage.
set -u
export PYTHONUNBUFFERED=1
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
O=/tmp/pdl-order-ab; mkdir -p "$O" "${OUT:-.}"
pack() { tar czf "${OUT:-.}/pdl-order-ab.tgz" -C "$O" . ; }
T0=$(date +%s)
i=0
for t in ${ORDER:-new base new base}; do
  i=$((i + 1))
  if [ $t = new ]; then src=$PWD/src; else src=$PWD/.ab/$t/src; fi
  PYTHONPATH=$src KBIT_COMMIT=$KBIT_COMMIT-$t timeout ${T_AB:-100} python benchmarks/bench_e2e.py \
    --models "${MODELS:-qwen3-30b-a3b}" ${LAYERS:+--layers $LAYERS} --k 4 --batch ${BATCH:-1,4} --steps 16 --reps 3 \
    --fuse-proj --no-kr --skip-bf16 --eager-steps 0 --out "$O" --name "e2e-$t$i" > "$O/e2e-$t$i.log" 2>&1
  echo "e2e $t$i rc $? after $(( $(date +%s) - T0 )) s"
  grep -E "^\| [a-z]" "$O/e2e-$t$i.md" 2>/dev/null | cut -c1-70
  pack
done
if [ "${T_TEST:-150}" -gt 1 ]; then
  PYTHONPATH=$PWD/src timeout ${T_ORDER:-120} python -m pytest -q -m gpu -p no:cacheprovider tests/test_pdl_order.py \
    > "$O/gpu-tests-pdl-order.log" 2>&1; echo "pdl order tests rc $? after $(( $(date +%s) - T0 )) s"
  tail -2 "$O/gpu-tests-pdl-order.log"; pack
  PYTHONPATH=$PWD/src timeout ${T_TEST:-150} python -m pytest -q -m gpu -p no:cacheprovider tests/test_grouped_mma.py \
    tests/test_moe.py tests/test_decode.py > "$O/gpu-tests.log" 2>&1; echo "tests rc $? after $(( $(date +%s) - T0 )) s"
  tail -2 "$O/gpu-tests.log"; pack
fi
if [ "${T_SCAN:-0}" -gt 1 ]; then
  timeout ${T_SCAN} python lab/pdl_hoist_scan.py --quick > "$O/scan.log" 2>&1; echo "scan rc $?"; tail -3 "$O/scan.log"
  pack
fi
