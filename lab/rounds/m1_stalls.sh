#!/bin/bash
# One device call (issue 32, M = 1 and 16): where kernel 3's warps wait, at the GPU's own clocks (ncu locks the SM
# clock by default, 1.33 GHz on an H200; the L1 it reported 89% busy at k = 4 there did not bound the kernel:
# docs/notes/2026-11-29-m1-x-load-l2-prefetch.md). Per (shape, k): the full set with
# source counters and --clock-control none, the stall reasons of the whole kernel (WarpStateStats) and the SASS lines
# with the most stall samples (lab/ncu_top.py).
#   Device tool: run(command="bash lab/rounds/m1_stalls.sh", timeout_s=400)
#   RUNS: shape:k:M triples (default: 100352x5120 at k = 4 and 2, 4096x14336 at k = 4, M = 1; 28672x4096 at k = 4,
#   M = 16, whose "L1 bound" of 2026-11-27 was also measured at the locked clock); KREGEX: the kernels ncu profiles
#   (default kbit_gemv_mma, kernels 1 and 3; kbit_wgmma for kernel 7 at M = 17..64)
# Returned: $OUT/m1-stalls.tgz (reports' text, source CSVs, summaries), $OUT/summary.txt.
set -u
R=${OUT:-/tmp/out}; O=/tmp/m1stalls; mkdir -p "$R" "$O"
trap 'tar czf "$R/m1-stalls.tgz" -C "$O" . ; cp "$O/summary.txt" "$R/" 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
for run in ${RUNS:-100352x5120:4:1 100352x5120:2:1 4096x14336:4:1 28672x4096:4:16}; do
  IFS=: read -r S K M <<< "$run"
  n=$S-k$K-m$M
  timeout 150 ncu --set full --import-source yes --clock-control none -k regex:${KREGEX:-kbit_gemv_mma} --launch-skip 1 -c 1 \
      -o "$O/$n" python lab/m16_profile.py --shape "$S" --k "$K" --ms "$M" --calls 2 > "$O/$n.log" 2>&1
  ncu -i "$O/$n.ncu-rep" --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section Occupancy --print-details all > "$O/$n.txt" 2>&1
  ncu -i "$O/$n.ncu-rep" --page source --csv --print-source sass > "$O/$n-source.csv" 2>/dev/null
  python lab/ncu_top.py "$O/$n-source.csv" 25 > "$O/$n-top.txt" 2>&1
  rm -f "$O/$n.ncu-rep"
  { echo "## $n"; grep -E "kernel [0-9]|Duration|SM Frequency|Issue Slots|Eligible Warps|Warp Cycles Per Issued|Stall" \
        "$O/$n.log" "$O/$n.txt" | cut -c1-150 | head -n 30; head -n 12 "$O/$n-top.txt"; } >> "$O/summary.txt"
done
cat "$O/summary.txt"
