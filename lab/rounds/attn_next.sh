#!/bin/bash
# One device call (issues 32, 36): what the 2026-11-28 round left for the GPU after the attention's merge rule
# (kbit.ops.attention.folds) shipped without a same-run A/B of the whole step. Needs the base tree (the rule before:
# e0fed91) under .ab/base (carry ".ab"): mkdir -p .ab/base && git archive e0fed91 src | tar -x -C .ab/base
# 1. bench_e2e with bf16 on the working tree (issue 36's table: ms a step, x bf16);
# 2. the whole step, new / base / new / base, batch 1 (lab/rounds/attn_merge_ab.sh, a real A/B since 83878b7);
# 3. --fold-ab with the one-pass second launch ("attn combine 1p"), batch 1, context 512 and 4096;
# 4. the fixed-config sweep at context 4096, batch 1 (the split count was fitted when the last split merged).
# Logs and tables: $OUT/attn-next.tgz, packed after each stage.
set -u
export PYTHONUNBUFFERED=1
O=/tmp/attn-next
mkdir -p "$O"
pack() { tar czf "${OUT:-.}/attn-next.tgz" -C "$O" . ; }
MODELS=${MODELS:-llama3-8b,qwen3-8b,qwen2.5-7b,qwen3-30b-a3b}
echo "== 1 e2e with bf16"
PYTHONPATH=$PWD/src timeout ${T_E2E:-200} python benchmarks/bench_e2e.py --models "$MODELS" --k 4 --batch 1,16 \
  --steps 16 --reps 3 --fuse-proj --no-kr --out "$O" --name e2e > "$O/e2e.log" 2>&1
echo "rc $?"; grep -E "^\| " "$O/e2e.md" 2>/dev/null | grep -v -- "---" | tail -n 17
pack
echo "== 2 whole-step A/B"
mkdir -p "$O/ab"
OUT=$O/ab MODELS=$MODELS BATCH=1 T_AB=${T_AB:-60} T_TEST=${T_TEST:-1} KBIT_COMMIT=${KBIT_COMMIT:-} \
  bash lab/rounds/attn_merge_ab.sh > "$O/ab.log" 2>&1
grep -E "^(==|rc|\| [a-z])" "$O/ab.log" | cut -c1-80
pack
echo "== 3 fold-ab"
PYTHONPATH=$PWD/src timeout ${T_FOLD:-120} python lab/attn_chain_sweep.py --fold-ab --models llama3-8b,qwen2.5-7b \
  --ctx 512,4096 --batch 1 --out "$O/fold" > "$O/fold-ab.log" 2>&1
echo "rc $?"; grep -A40 "^{'gpu'" "$O/fold-ab.log" | tail -n 25
pack
echo "== 4 sweep, context 4096"
PYTHONPATH=$PWD/src timeout ${T_SWEEP:-120} python lab/attn_chain_sweep.py --models llama3-8b,qwen2.5-7b --ctx 4096 \
  --batch 1 --out "$O/sweep" > "$O/sweep.log" 2>&1
echo "rc $?"; grep -A30 "^{'gpu'" "$O/sweep.log" | tail -n 22
pack
