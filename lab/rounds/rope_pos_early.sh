#!/bin/bash
# One device call (issues 32, 36): rope_append reads the step's position and its cos / sin rows before the PDL wait
# (pos_settled=True in the fast decode step). Needs the base tree (the same step reading them after the wait) under
# .ab/base (carry ".ab"):   mkdir -p .ab/base && git archive <base> src | tar -x -C .ab/base
# 1. GPU tests: rope_append (fp16 / bf16, both orders) and pytest -m gpu on the decode tests;
# 2. the whole step, new / base / new / base, batch 1, k = 4 (lab/rounds/attn_merge_ab.sh);
# 3. the end-to-end bar: bench_e2e with bf16 in the same run, batch 1, k = 4, the working tree.
# Logs and tables: $OUT/rope-pos-early.tgz, packed after each stage.
set -u
export PYTHONUNBUFFERED=1
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
O=/tmp/rope-pos-early
mkdir -p "$O"
pack() { tar czf "${OUT:-.}/rope-pos-early.tgz" -C "$O" . ; }
echo "== 1 tests"
PYTHONPATH=$PWD/src timeout ${T_TEST:-100} python -m pytest -q -p no:cacheprovider tests/test_glue.py -k rope \
  > "$O/gpu-tests-glue.log" 2>&1; echo "rc $?"; tail -1 "$O/gpu-tests-glue.log"
PYTHONPATH=$PWD/src timeout ${T_TEST:-100} python -m pytest -q -m gpu -p no:cacheprovider tests/test_decode.py \
  > "$O/gpu-tests-decode.log" 2>&1; echo "rc $?"; tail -1 "$O/gpu-tests-decode.log"
pack
echo "== 2 whole-step A/B"
mkdir -p "$O/ab"
OUT=$O/ab MODELS=${MODELS:-llama3-8b,qwen3-8b,qwen2.5-7b} BATCH=1 T_AB=${T_AB:-50} T_TEST=1 \
  KBIT_COMMIT=$KBIT_COMMIT bash lab/rounds/attn_merge_ab.sh > "$O/ab.log" 2>&1
grep -E "^(==|\| [a-z])" "$O/ab.log" | grep -v "gpu tests" | cut -c1-60
pack
echo "== 3 bf16 and kbit, batch 1"
PYTHONPATH=$PWD/src timeout ${T_E2E:-110} python benchmarks/bench_e2e.py --models llama3-8b,qwen3-8b,qwen2.5-7b --k 4 \
  --batch 1 --steps 16 --reps 3 --fuse-proj --no-kr --eager-steps 0 --out "$O" --name "e2e-h100-${DATE:-$(date +%F)}c-b1" \
  > "$O/e2e.log" 2>&1; echo "rc $?"; grep -A6 '^```' "$O"/e2e-h100-*-b1.md | head -n 8
pack
