#!/bin/bash
# One device call: the decode step of trees against each other (carry ".ab"; ORDER: "new" is src, any other name
# .ab/<name>/src; made for the SwiGLU staged by the down pairs launch, XSILU): 1. GPU tests (TEST_TREE: a tree with
# src and tests, default .ab/xsilu; TEST_FILES, TEST_K); 2. a step profile of src's Qwen3-30B-A3B-shaped batch-1 step
# (PROFILE=1, PROF_LAYERS); 3. bench_e2e a fresh process a run (MODELS, BATCH). Logs: $OUT/xsilu-ab.tgz.
set -u
export PYTHONUNBUFFERED=1
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
O=/tmp/xsilu-ab; mkdir -p "$O" "${OUT:-.}"
pack() { tar czf "${OUT:-.}/xsilu-ab.tgz" -C "$O" . ; }
T0=$(date +%s)
. "$(dirname "$0")/e2e_lib.sh"
(cd ${TEST_TREE:-.ab/xsilu} && PYTHONPATH=$PWD/src timeout ${T_TEST:-150} python -m pytest -q -m gpu \
  -p no:cacheprovider ${TEST_FILES:-tests/test_grouped_mma.py tests/test_moe.py} -k "${TEST_K:-pairs or moe}" \
  > "$O/gpu-tests.log" 2>&1)
echo "tests rc $? after $(( $(date +%s) - T0 )) s"; tail -3 "$O/gpu-tests.log"; pack
if [ "${PROFILE:-1}" = 1 ]; then
  PYTHONPATH=$PWD/src KBIT_COMMIT=$KBIT_COMMIT timeout ${T_PROF:-150} python benchmarks/bench_e2e.py \
    --models qwen3-30b-a3b --k 4 --batch 1 --steps 16 --reps 3 --fuse-proj --no-kr --skip-bf16 --eager-steps 0 \
    --profile --layers ${PROF_LAYERS:-4} --out "$O" --name profile > "$O/profile.log" 2>&1
  echo "profile rc $? after $(( $(date +%s) - T0 )) s"; pack
fi
e2e_trees "new base xsilu new base xsilu" qwen3-30b-a3b 1,4 110 90
