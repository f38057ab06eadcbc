#!/bin/bash
# One device call (issue 36): the fused residual add + RMSNorm prologue only where the plain launch is kernel 3
# (kbit.tuning.mma_plan.prologue_config; lab/prologue_sweep.py measured the fused launch slower than the separate
# steps where the plain pick is kernel 1). Trees (carry ".ab"):
#   ./src           kernel 3 only (working tree)
#   .ab/base/src    fused wherever x fits (the commit before)   mkdir -p .ab/base && git archive <base> src | tar -x -C .ab/base
#   .ab/nofuse/src  never fused (prologue_config returns None)
# 1. GPU tests of the prologue and the decode step (working tree);
# 2. the whole step, batch 1, k = 4 (K), a fresh process a run, ORDER (default new base nofuse, twice).
# Returned: $OUT/prologue-ab.tgz, packed after each run.
set -u
export PYTHONUNBUFFERED=1
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
O=/tmp/prologue-ab; mkdir -p "$O" "${OUT:-.}"
pack() { tar czf "${OUT:-.}/prologue-ab.tgz" -C "$O" . ; }
tree() { case $1 in new) echo "$PWD/src" ;; *) echo "$PWD/.ab/$1/src" ;; esac; }
T0=$(date +%s)
if [ "${T_TEST:-150}" -gt 1 ]; then
  PYTHONPATH=$PWD/src timeout ${T_TEST:-150} python -m pytest -q -m gpu -p no:cacheprovider tests/test_prologue.py \
    tests/test_decode.py > "$O/gpu-tests.log" 2>&1; echo "tests rc $? after $(( $(date +%s) - T0 )) s"
  tail -2 "$O/gpu-tests.log"; pack
fi
i=0
for t in ${ORDER:-new base nofuse new base nofuse}; do
  i=$((i + 1))
  PYTHONPATH=$(tree $t) KBIT_COMMIT=$KBIT_COMMIT-$t timeout ${T_AB:-70} python benchmarks/bench_e2e.py \
    --models "${MODELS:-llama3-8b,qwen3-8b,qwen2.5-7b}" --k ${K:-4} --batch ${BATCH:-1} --steps 16 --reps 3 \
    --fuse-proj --no-kr --skip-bf16 --eager-steps 0 --out "$O" --name "e2e-$t$i" > "$O/e2e-$t$i.log" 2>&1
  echo "e2e $t$i rc $? after $(( $(date +%s) - T0 )) s"
  grep -E "^\| [a-z]" "$O/e2e-$t$i.md" 2>/dev/null | cut -c1-70
  pack
done
