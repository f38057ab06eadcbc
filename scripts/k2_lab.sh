#!/bin/bash
# k = 2 M = 1 lookup lab (session 16): ncu pipe / issue statistics of kernel 3 on 57344x8192 (k = 2 and k = 4).
# The K2HI timing variants of that session (selector shifts as mul.hi on the FMA pipe; slower, k2-lab-s16.log) were
# removed from the source afterwards; run this script on a tree of commit 518d129 or earlier to repeat them
# (K2HI = 1 / 2 columns of scripts/m1_cfg_sweep.py with @KBIT_LAB_DEFINES=K2HI=...).
export PYTHONPATH=src PYTHONUNBUFFERED=1
for k in 2 4; do
  n=k${k}
  timeout 200 ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section InstructionStats --section WarpStateStats --section Occupancy -k regex:kbit_gemv_mma -s 2 -c 1 \
    -o $OUT/$n -f python scripts/m1_cfg_sweep.py --ncu --shapes ${SHAPE:-57344x8192} --ks $k --ms 1 \
    > $OUT/ncu_$n.log 2>&1
  ncu -i $OUT/$n.ncu-rep --page details --print-details all > $OUT/${n}_details.txt 2>&1
  echo "== $n"
  grep -iE "Duration|Issued Ipc|Issue Slots|Eligible Warps|Pipe|Warp Cycles Per Issued|DRAM Throughput" \
    $OUT/${n}_details.txt | head -24
done
