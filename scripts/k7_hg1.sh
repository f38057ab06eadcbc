#!/bin/bash
# Lab: kernel 7 with one wgmma a commit group and four A buffers (HG1) against the default, dense and grouped.
export PYTHONPATH=src PYTHONUNBUFFERED=1
echo "== check HG1"
KBIT_LAB_DEFINES=HG1=1 timeout 110 python scripts/large7_lab.py --quick-check --check-cfgs "7,8,32,4,8,1,1;7,8,32,4,8,1,2;7,12,16,4,8,1,2,0,1" \
  --cfgs "7,8,32,4,8,1,1" --ms 4096 --ks 4 --shapes 4096x4096 --no-deq --out $OUT/chk 2>&1 | grep -E "FAIL|failures"
for v in base HG1=1; do
  lab=$v; [ $v = base ] && lab=""
  echo "== dense $v"
  KBIT_LAB_DEFINES=$lab timeout 140 python scripts/large7_lab.py --cfgs "7,8,32,4,8,1,1;7,8,32,4,8,1,2" --ms 1024,4096 --ks 4,2 \
    --shapes 28672x4096,8192x28672,4096x14336 --no-check --no-deq --budget 105 --out $OUT/d_${v//=/_} 2>&1 | grep "^|"
done
for v in base HG1=1; do
  lab=$v; [ $v = base ] && lab=""
  echo "== grouped $v"
  KBIT_LAB_DEFINES=$lab timeout 140 python scripts/moe_lab.py --tokens 1024,4096 --kernels 7 --check "${CHK:-}" \
     --budget 105 --out $OUT/g_${v//=/_} 2>&1 | grep -E "^\||fail"
done
