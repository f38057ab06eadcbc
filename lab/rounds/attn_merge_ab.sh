#!/bin/bash
# GPU round: the decode attention's one-pass fold (kbit.kernels.attention._combine_store) against the two-pass one.
# Needs the base tree unpacked under .ab/base (carry ".ab"):
#   mkdir -p .ab/base && git archive <base> src | tar -x -C .ab/base
# 1. decode steps, each a fresh process, alternating new / base / new / base (bench_e2e, k = 4, batch 1, 4, 16);
# 2. pytest -m gpu on the attention and decode tests (working tree);
# Logs and tables: $OUT/attn-merge-ab.tgz (packed after each stage).
# 3. the attention configs in the step with the new fold (lab/attn_chain_sweep.py, context 512, batch 1).
set -u
export PYTHONUNBUFFERED=1
O=/tmp/attn-merge-ab
mkdir -p "$O"
pack() { tar czf "${OUT:-.}/attn-merge-ab.tgz" -C "$O" . ; }  # the device tool returns at most 8 files
MODELS=${MODELS:-llama3-8b,qwen3-8b,qwen2.5-7b}
i=0
for t in new base new base; do
  i=$((i + 1))
  if [ $t = new ]; then src=$PWD/src; else src=$PWD/.ab/base/src; fi
  echo "== $i $t"
  PYTHONPATH=$src KBIT_COMMIT=${KBIT_COMMIT:-}-$t timeout ${T_AB:-120} python benchmarks/bench_e2e.py --models "$MODELS" --k 4 \
    --batch ${BATCH:-1,4,16} --steps 16 --reps 3 --fuse-proj --no-kr --skip-bf16 --eager-steps 0 --out "$O" \
    --name "ab-$t$i" > "$O/ab-$t$i.log" 2>&1
  echo "rc $?"; grep -E "^\| " "$O/ab-$t$i.md" 2>/dev/null | grep -v -- "---" | cut -c1-110 | tail -n 12
  pack
done
echo "== gpu tests"
PYTHONPATH=$PWD/src timeout ${T_TEST:-150} python -m pytest -q -m gpu -p no:cacheprovider tests/test_attention.py tests/test_decode.py \
  > "$O/gpu-tests.log" 2>&1; echo "rc $?"; tail -3 "$O/gpu-tests.log"
pack
if [ -n "${SWEEP:-}" ]; then
  echo "== sweep"
  PYTHONPATH=$PWD/src timeout 200 python lab/attn_chain_sweep.py --models "$SWEEP" --ctx 512 --batch 1 --out "$O" \
    > "$O/sweep.log" 2>&1; echo "rc $?"; tail -n 25 "$O/sweep.log"
  pack
fi
