#!/bin/bash
# One device call (issue 32, M = 1): k = 4's wide lookup table at M = 1 only (lab/patches/k4-wide-m1.patch: the
# plan's rule, its kernel path and its CPU test), in a tree made on the device from src plus the patch, against src.
# Measured on 2026-11-29 in forms that were not shipped: benchmarks/results/h200/k4-wide-table-2026-11-29/.
#   PART=e2e: the batch-1 decode step, k = 4, Llama-3-8B- and Qwen3-8B-shaped (MODELS), base / wide alternated
#             twice (bench_e2e.py, graphs, the fast step); then the GPU tests of the kernels, plans and prologues
#             the change touches, in the wide tree
#   PART=suite: `lab/rounds/patch_ab.sh` on the suite's dense shapes of >= 100M weights at M = 1, k = 4 (SH)
#   Device tool: run(command="PART=e2e bash lab/rounds/wide_m1.sh", timeout_s=600)
set -u
R=${OUT:-/tmp/out}; O=/tmp/widem1; mkdir -p "$R" "$O"
trap 'cp "$O"/*.md "$O"/*.log "$R"/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
W=$O/tree; rm -rf "$W"; mkdir -p "$W"; cp -r src tests pyproject.toml "$W"/
(cd "$W" && patch -s -p1 < "$OLDPWD/lab/patches/k4-wide-m1.patch") || { echo "patch failed"; exit 1; }
if [ "${PART:-e2e}" = e2e ]; then
  for i in 1 2; do
    for t in base wide; do
      if [ $t = wide ]; then src=$W/src; else src=$PWD/src; fi
      PYTHONPATH=$src timeout 150 python benchmarks/bench_e2e.py --models "${MODELS:-llama3-8b,qwen3-8b}" --k 4 \
        --batch 1 --skip-bf16 --fuse-proj --no-kr --steps 16 --reps 3 --out "$O" --name "e2e-$t-$i" \
        > "$O/e2e-$t-$i.log" 2>&1
      echo "e2e $t $i rc $? $(grep -E '\| kbit \| 4 \| 1 \|' "$O/e2e-$t-$i.md" | head -3 | tr '\n' ' ')"
    done
  done
  (cd "$W" && PYTHONPATH=$W/src timeout "${TEST_TIMEOUT:-300}" python -m pytest -v -p no:cacheprovider -m gpu -n 8 \
    tests/test_gemv_mma.py tests/test_prologue.py tests/test_dense_plans.py tests/test_decode.py) > "$O/tests.log" 2>&1
  grep -c " PASSED " "$O/tests.log" | sed 's/$/ passed/'
  grep -oE "(FAILED|ERROR) tests/[^ ]+" "$O/tests.log" | sort -u | head -n 20
  tail -n 1 "$O/tests.log"
else
  TREES="wide=lab/patches/k4-wide-m1.patch" RUNS=${RUNS:-base wide wide base} KS=4 MS=1 TB=${TB:-150} \
    SH=${SH:-262208x5376,151936x5120,131072x5120,151936x4096,100352x5120,65536x5120,151936x2048,51200x5120,43008x5376,35840x5120,34816x5120,5120x32768,5120x25600,5376x21504,24576x4096,28672x4096,57344x8192,8192x28672} \
    bash lab/rounds/patch_ab.sh
fi
