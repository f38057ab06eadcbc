#!/bin/bash
# One device call (issue 36): rotary and the cache append folded into the attention's split programs
# (kbit.ops.attention.rope_decode_attention), checked and timed in the whole step. Needs the base tree (the step with
# rope_append as its own launch: 66e08ad) under .ab/base (carry ".ab"):
#   mkdir -p .ab/base && git archive 66e08ad src | tar -x -C .ab/base
# 1. the fused op's tests on the GPU (fp16, the kernel itself), and pytest -m gpu on the decode tests;
# 2. the whole step, new / base / new / base, batch 1 (lab/rounds/attn_merge_ab.sh).
# Logs and tables: $OUT/rope-fused.tgz, packed after each stage.
set -u
export PYTHONUNBUFFERED=1
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
O=/tmp/rope-fused
mkdir -p "$O"
pack() { tar czf "${OUT:-.}/rope-fused.tgz" -C "$O" . ; }
echo "== 1 tests"
PYTHONPATH=$PWD/src timeout ${T_TEST:-100} python -m pytest -q -p no:cacheprovider tests/test_attention.py -k rope \
  > "$O/gpu-tests-rope.log" 2>&1; echo "rc $?"; tail -1 "$O/gpu-tests-rope.log"
PYTHONPATH=$PWD/src timeout ${T_TEST:-100} python -m pytest -q -m gpu -p no:cacheprovider tests/test_decode.py \
  > "$O/gpu-tests-decode.log" 2>&1; echo "rc $?"; tail -1 "$O/gpu-tests-decode.log"
pack
echo "== 2 whole-step A/B"
mkdir -p "$O/ab"
OUT=$O/ab MODELS=${MODELS:-llama3-8b,qwen3-8b,qwen2.5-7b} BATCH=${BATCH:-1} T_AB=${T_AB:-50} T_TEST=1 \
  KBIT_COMMIT=$KBIT_COMMIT bash lab/rounds/attn_merge_ab.sh > "$O/ab.log" 2>&1
grep -E "^(==|rc|\| [a-z])" "$O/ab.log" | grep -v "gpu tests" | cut -c1-60
pack
