#!/usr/bin/env bash
# A/B of kernel 3's x load at M = 1: fresh processes per tree, in the order given; ncu wavefronts of each tree at k = 4
set -u
mkdir -p $OUT; L=/tmp/xab; mkdir -p $L
SH=${SH:-100352x5120,151936x4096,5120x32768,5376x21504,43008x5376,8192x5376,4096x14336}
i=0
for T in ${TREES:-base v1 v3 v1 base}; do
  i=$((i+1))
  PYTHONPATH=$PWD/.ab/$T/src timeout ${TB:-110} python -m kbit.cli bench --shapes $SH --m 1 --k ${KS:-2,4} \
    --candidates kbit-linear --no-ceiling --moe none --out $L --name r$i-$T > $L/r$i-$T.log 2>&1
  echo "run $i $T rc $?" | tee -a $L/runs.txt
done
for T in ${NCU_TREES:-}; do
  PYTHONPATH=$PWD/.ab/$T/src ncu --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts.sum,smsp__inst_executed_op_shared_ld.sum,gpu__time_duration.sum,sm__cycles_elapsed.avg \
    -k regex:kbit_gemv_mma --launch-skip 1 -c 1 python lab/m16_profile.py --shape 100352x5120 --k 4 --ms 1 --calls 2 > $L/ncu-$T.txt 2>&1
  grep -E "l1tex|gpu__|sm__|smsp" $L/ncu-$T.txt | sed "s/^/$T /"
done
tar czf $OUT/xab.tgz -C $L .
[ -n "${TEST_TREE:-}" ] && PYTHONPATH=$PWD/.ab/$TEST_TREE/src timeout ${TT:-110} python -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/test_gemv_mma.py > $L/tests.log 2>&1
tail -3 $L/tests.log 2>/dev/null
tar czf $OUT/xab.tgz -C $L .
for f in $L/h200/r*.json; do python - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"] if isinstance(d, dict) and "rows" in d else d
for r in rows:
    if r.get("kernel") == "kbit-linear":
        print(sys.argv[1].split("/")[-1][:8], r.get("k"), r.get("N"), r.get("K"), r.get("M"), r.get("us"), r.get("err"))
PY
done
