set -u
# One device call (2026-11-27): the decode step without the k = 4 64 KB lookup table (T64, taken out) against the
# tree before (_trees/base: mkdir -p _trees/base && git archive <base> src | tar -x -C _trees/base), Llama-3-8B-shaped,
# k = 4, batch 1 (bench_e2e.py, graphs, fast step), base / head alternated twice; then the GPU tests of the kernels
# and plans the change touches. Device tool: run(command="BASE=<base> bash lab/rounds/t64_e2e.sh", timeout_s=600)
R=$OUT; O=/tmp/t64e; mkdir -p $O
trap 'cp $O/*.md $O/*.log $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
M=${MODELS:-llama3-8b}
for i in 1 2; do
  for t in base head; do
    if [ $t = head ]; then src=$PWD/src; else src=$PWD/_trees/base/src; fi
    PYTHONPATH=$src timeout 150 python benchmarks/bench_e2e.py --models $M --k 4 --batch 1 --skip-bf16 --fuse-proj \
      --no-kr --steps 16 --reps 3 --out $O --name e2e-$t-$i > $O/e2e-$t-$i.log 2>&1
    echo "e2e $t $i rc $? $(grep -E '\| kbit \| 4 \| 1 \|' $O/e2e-$t-$i.md | head -3 | tr '\n' ' ')"
  done
done
export PYTHONPATH=$PWD/src
timeout ${TEST_TIMEOUT:-300} python -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/test_gemv_mma.py \
  tests/test_prologue.py tests/test_dense_plans.py > $O/tests.log 2>&1
grep -E "passed|failed|FAILED|ERROR" $O/tests.log | tail -n 12
