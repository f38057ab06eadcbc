#!/bin/bash
# One device call: the GPU tests of the MoE, layout, grouped, decode and attention files (TEST_FILES), then step
# profiles (bench_e2e.py --profile, PROF_LAYERS layers) of MODELS at BATCH, each its own process. Needs
# KBIT_COMMIT. Logs: $OUT/profile-tests.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
O=/tmp/profile-tests; mkdir -p "$O" "${OUT:-.}"
pack() { tar czf "${OUT:-.}/profile-tests.tgz" -C "$O" . ; }
T0=$(date +%s)
timeout ${T_TEST:-240} python -m pytest -q -p no:cacheprovider -m gpu -n ${XDIST:-4} \
  ${TEST_FILES:-tests/test_moe.py tests/test_layout.py tests/test_grouped_mma.py tests/test_decode.py \
  tests/test_attention.py} > "$O/gpu-tests.log" 2>&1
echo "tests rc $? after $(( $(date +%s) - T0 )) s"; grep -E "passed|failed" "$O/gpu-tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$O/gpu-tests.log" | head; pack
for m in ${MODELS:-qwen3-30b-a3b qwen3-8b}; do
  for b in ${BATCH:-1}; do
    timeout ${T_PROF:-120} python benchmarks/bench_e2e.py --models $m --k 4 --batch $b --steps 16 --reps 3 \
      --fuse-proj --no-kr --skip-bf16 --eager-steps 0 --profile --layers ${PROF_LAYERS:-4} --out "$O" \
      --name profile-$m-b$b > "$O/profile-$m-b$b.log" 2>&1
    echo "profile $m b$b rc $? after $(( $(date +%s) - T0 )) s"; pack
    f=$(ls "$O"/step-$m-kbit-k4-b$b.txt 2>/dev/null | head -1)
    [ -n "$f" ] && sed -n '/top 12 on the critical path/,/^$/p' "$f" | cut -c1-150 && grep -E "^step |^bytes" "$f"
  done
done
