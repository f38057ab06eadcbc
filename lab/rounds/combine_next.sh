#!/bin/bash
# One device call (issues 32, 36): the attention's second launch loading a step's partials together (a48e958) checked
# and timed, and what the merge rule and the split count should be with it. Needs the base tree (the second launch
# before: ffea04e) under .ab/base (carry ".ab"): mkdir -p .ab/base && git archive ffea04e src | tar -x -C .ab/base
# 1. pytest -m gpu on the attention and decode tests (working tree);
# 2. the whole step, new / base / new / base, batch 1 (lab/rounds/attn_merge_ab.sh);
# 3. --fold-ab at batch 4 and 16: the merge rule's fold against the new second launch;
# 4. the fixed-config sweep at context 16384, batch 1.
# Logs and tables: $OUT/combine-next.tgz, packed after each stage.
set -u
export PYTHONUNBUFFERED=1
O=/tmp/combine-next
mkdir -p "$O"
pack() { tar czf "${OUT:-.}/combine-next.tgz" -C "$O" . ; }
echo "== 1 gpu tests"
PYTHONPATH=$PWD/src timeout ${T_TEST:-150} python -m pytest -q -m gpu -p no:cacheprovider tests/test_attention.py \
  tests/test_decode.py > "$O/gpu-tests.log" 2>&1; echo "rc $?"; tail -3 "$O/gpu-tests.log"
pack
echo "== 2 whole-step A/B"
mkdir -p "$O/ab"
OUT=$O/ab MODELS=${MODELS:-llama3-8b,qwen3-8b,qwen2.5-7b,qwen3-30b-a3b} BATCH=1 T_AB=${T_AB:-60} T_TEST=1 \
  KBIT_COMMIT=${KBIT_COMMIT:-} bash lab/rounds/attn_merge_ab.sh > "$O/ab.log" 2>&1
grep -E "^(==|rc|\| [a-z])" "$O/ab.log" | grep -v "gpu tests" | cut -c1-60
pack
echo "== 3 fold-ab, batch 4 and 16"
PYTHONPATH=$PWD/src timeout ${T_FOLD:-150} python lab/attn_chain_sweep.py --fold-ab \
  --models llama3-8b,qwen2.5-7b,qwen3-30b-a3b --ctx 512,4096 --batch 4,16 --out "$O/fold" > "$O/fold-ab.log" 2>&1
echo "rc $?"; grep -A60 "^{'gpu'" "$O/fold-ab.log" | tail -n 50 | cut -c1-75
pack
echo "== 4 sweep, context 16384"
PYTHONPATH=$PWD/src timeout ${T_SWEEP:-100} python lab/attn_chain_sweep.py --models llama3-8b,qwen2.5-7b --ctx 16384 \
  --batch 1 --out "$O/sweep" > "$O/sweep.log" 2>&1
echo "rc $?"; grep -A30 "^{'gpu'" "$O/sweep.log" | tail -n 22 | cut -c1-75
pack
