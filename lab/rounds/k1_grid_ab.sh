#!/bin/bash
# One device call (issue 32): kernel 1's grid filling every CTA slot (working tree) against the plan's grid of
# ceil(items / ceil(items / slots)) CTAs (.ab/base: git archive <base> src | tar -x -C .ab/base; carry ".ab"), through
# the dispatcher on the suite points whose kernel-1 grid the change moves (a CPU listing with the shipped H100 table:
# 11 points of >= 16M weights at M <= 16) and neighbours, fresh processes base / new / base / new; then the GPU tests
# of the small-M kernels on the working tree (SHARDS > 0: in that many processes, lab/pytest_shards.sh). Returned:
# $OUT/k1-grid-ab.tgz. SHAPES, KS, MS: the points (default: the 2026-11-27 round's).
set -u
O=/tmp/k1g; mkdir -p $O
pack() { tar czf "${OUT:-.}/k1-grid-ab.tgz" -C $O . ; }
export PYTHONUNBUFFERED=1
SH=${SHAPES:-5120x8192,8192x8192,16384x16384,8192x28672,5120x17408,9216x4096}
i=0
for t in base new base new; do
  i=$((i + 1))
  if [ $t = new ]; then src=$PWD/src; else src=$PWD/.ab/base/src; fi
  PYTHONPATH=$src timeout 150 python -m kbit.cli bench --shapes $SH --k ${KS:-2,4} --m ${MS:-1,2,4} --candidates kbit-linear \
    --no-ceiling --budget-s ${BUDGET:-130} --commit "${KBIT_COMMIT:-}-$t" --out $O/$t$i --name k1grid > $O/bench-$t$i.log 2>&1
  echo "bench $t$i rc $?"
  pack
done
if [ "${SHARDS:-0}" -gt 0 ]; then
  mkdir -p $O/tests; PYTHONPATH=$PWD/src LOGDIR=$O/tests timeout ${T_TEST:-240} bash lab/pytest_shards.sh \
    tests/test_gemv_mma.py -m gpu > $O/gpu-tests.log 2>&1; echo "tests rc $?"; cat $O/gpu-tests.log
else
  PYTHONPATH=$PWD/src timeout ${T_TEST:-240} python -m pytest -q -m gpu -x -p no:cacheprovider tests/test_gemv_mma.py \
    > $O/gpu-tests.log 2>&1; echo "tests rc $?"; tail -n 2 $O/gpu-tests.log
fi
pack
