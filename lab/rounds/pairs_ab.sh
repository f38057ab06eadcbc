#!/bin/bash
# One device call: MoE pairs as one dense GEMV (kbit.ops.gemv_mma.pairs_linear) against the tree before (.ab/base;
# carry ".ab"): 1. GPU tests (TESTS; default: the grouped kernels, the MoE layer and the decode step);
# 2. lab/moe_t1_lab.py (six MoE shapes, the grouped kernels, the pairs launch and the dense path on the same bytes);
# 3. the decode step in the trees of ORDER (default new base new base), a fresh process a run (bench_e2e, MODELS,
# BATCH: one or a comma list). Logs: $OUT/pairs-ab.tgz.
set -u
export PYTHONUNBUFFERED=1
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
O=/tmp/pairs-ab; mkdir -p "$O" "${OUT:-.}"
pack() { tar czf "${OUT:-.}/pairs-ab.tgz" -C "$O" . ; }
T0=$(date +%s)
. "$(dirname "$0")/e2e_lib.sh"
PYTHONPATH=$PWD/src timeout ${T_TEST:-200} python -m pytest -q -m gpu -p no:cacheprovider \
  ${TESTS:-tests/test_grouped_mma.py tests/test_moe.py tests/test_decode.py} > "$O/gpu-tests.log" 2>&1
echo "tests rc $? after $(( $(date +%s) - T0 )) s"; tail -3 "$O/gpu-tests.log"; pack
if [ "${T_LAB:-90}" -gt 1 ]; then
  PYTHONPATH=$PWD/src KBIT_COMMIT=$KBIT_COMMIT timeout ${T_LAB:-90} python lab/moe_t1_lab.py --budget 60 --out "$O" \
    > "$O/lab.log" 2>&1; echo "lab rc $? after $(( $(date +%s) - T0 )) s"; grep -A14 "^| model" "$O/lab.log"; pack
fi
e2e_trees "new base new base" qwen3-30b-a3b,mixtral-8x7b 1 110 70
