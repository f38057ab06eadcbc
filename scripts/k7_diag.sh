#!/bin/bash
# Kernel 7 diagnosis (lab): timing variants without the lookups / the scale fold (wrong results, KBIT_LAB_DEFINES),
# then one ncu launch with source counters. Usage on the device: bash scripts/k7_diag.sh  (writes under $OUT)
export PYTHONPATH=src PYTHONUNBUFFERED=1
CFG=${CFG:-7,8,32,4,8,1,1}
for v in ${VARIANTS:-base LAB_NOLOOKUP=1 LAB_NOFOLD=1 LAB_NOLOOKUP=1,LAB_NOFOLD=1}; do
  d=$OUT/var_${v//[=,]/_}; mkdir -p $d
  lab=$v; [ $v = base ] && lab=""
  echo "== variant $v"
  KBIT_LAB_DEFINES=$lab timeout 200 python scripts/large7_lab.py --cfgs "$CFG" --ms ${MS:-1024,4096} --ks ${KS:-4,2} \
    --shapes ${SHAPES:-28672x4096,8192x28672} --no-check --no-deq --budget 150 --out $d 2>&1 | grep "^|"
done
if [ -z "$NO_NCU" ]; then
  timeout 240 ncu --clock-control none --section SourceCounters --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section SpeedOfLight -k regex:kbit_gemv_mma -c 1 -o $OUT/k7 -f \
    python scripts/large7_lab.py --ncu ${NCU_SHAPE:-28672x4096x4096} --cfgs "$CFG" > $OUT/ncu_run.log 2>&1
  tail -3 $OUT/ncu_run.log
  ncu -i $OUT/k7.ncu-rep --page details --print-details all > $OUT/k7_details.txt 2>&1
  grep -E "Tensor|Issued Ipc|Eligible Warps|Warp Cycles Per Issued|Duration" $OUT/k7_details.txt | head -12
  ncu -i $OUT/k7.ncu-rep --page source --csv --print-source sass > $OUT/k7_src.csv 2>$OUT/k7_src.err
  python scripts/ncu_top.py $OUT/k7_src.csv 45 || head -c 3000 $OUT/k7_src.err
fi
