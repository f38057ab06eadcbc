#!/bin/bash
# k = 2 M = 1 lookup lab (session 16): timing of the K2HI variants (selector shifts as multiply-high, FMA pipe
# instead of ALU), then ncu pipe / issue statistics of kernel 3 on 57344x8192 (k = 2 K2HI = 0 / 2, k = 4).
export PYTHONPATH=src PYTHONUNBUFFERED=1
H1="@KBIT_LAB_DEFINES=K2HI=1"; H2="@KBIT_LAB_DEFINES=K2HI=2"
python scripts/m1_cfg_sweep.py --check --shapes ${SHAPES:-57344x8192,8192x28672,28672x4096,4096x14336,6144x4096,4096x4096} \
  --ks 2 --ms 1 --cfgs "3,8,2,2,1;3,8,2,2,1$H1;3,8,2,2,1$H2;1,8,2$H1;1,8,2$H2;$H1;$H2" 2>&1 | grep -v Warn | tail -8
[ -n "$NO_NCU" ] && exit 0
for v in 2:0 2:2 4:0; do
  k=${v%:*}; h=${v#*:}; n=k${k}h$h
  timeout 200 ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section InstructionStats --section WarpStateStats --section Occupancy -k regex:kbit_gemv_mma -s 2 -c 1 \
    -o $OUT/$n -f env KBIT_LAB_DEFINES=K2HI=$h python scripts/m1_cfg_sweep.py --ncu --shapes 57344x8192 --ks $k \
    --ms 1 > $OUT/ncu_$n.log 2>&1
  ncu -i $OUT/$n.ncu-rep --page details --print-details all > $OUT/${n}_details.txt 2>&1
  echo "== $n"
  grep -iE "Duration|Issued Ipc|Issue Slots|Eligible Warps|Pipe|Warp Cycles Per Issued|DRAM Throughput" \
    $OUT/${n}_details.txt | head -24
done
