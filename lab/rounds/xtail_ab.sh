set -u
# One device call (2026-11-27): x read in place where K is not a multiple of 256 (XT builds) against the base tree
# (_trees/base, the commit before: x copied into a zero-padded buffer on every call), through the dispatcher on
# layers of that kind (DeepSeek-V2-Lite / Qwen2.5-72B down, gemma-3 and gpt-oss vocabularies and qkv, GLM-4.5-Air
# expert down, Qwen2.5-0.5B) and one control (K = 4096), two rounds a tree; then the GPU tests of the changed code.
# PART=moe: the grouped kernels instead, on the suite's gpt-oss and GLM-4.5-Air expert stacks (K = 2880, 1408)
# (measured with a grouped XT at 55027b2 and 4ec045b; not kept, see docs/notes/2026-11-27-x-in-place-suite-m1.md).
#   mkdir -p _trees/base && git archive <base> src | tar -x -C _trees/base
#   Device tool: run(command="BASE=<base> [PART=moe] bash lab/rounds/xtail_ab.sh", timeout_s=600)
# BASE_TREE: the folder under _trees/ (default base); TESTS_K: a pytest -k filter for the tests (default: all)
P=${PART:-dense}; R=$OUT; O=/tmp/xt-out-$P; mkdir -p $O
trap 'tar czf $R/xtail-$P-logs.tgz -C $O . ; cp $O/summary.txt $R/summary-$P.txt 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $O/summary.txt
SH=${SHAPES:-4096x10944,8192x29568,201088x2880,5120x2880,4096x1408,9728x896,1152x896,4096x4096}
if [ "$P" = moe ]; then
  WHAT="--suite models --suite-parts moe --families gpt-oss,glm4.5 --k 2,4,5 --tokens 1,4,16,64 --candidates grouped_mma"
  TESTS="tests/test_grouped_mma.py tests/test_moe.py"; NX=3; CAND=grouped_mma
else
  WHAT="--shapes $SH --k 2,4,5 --m 1,4,16 --candidates kbit-linear"
  TESTS="tests/test_gemv_mma.py tests/test_prologue.py"; NX=8; CAND=kbit-linear
fi
for i in 1 2; do
  for t in base head; do
    if [ $t = head ]; then src=$PWD/src; c=${KBIT_COMMIT:-head}; else src=$PWD/_trees/${BASE_TREE:-base}/src; c=$BASE; fi
    PYTHONPATH=$src timeout 150 python -m kbit.cli bench $WHAT --no-ceiling --commit $c --out $O/$t-$i \
      --name xtail > $O/bench-$t-$i.log 2>&1
    echo "bench $t $i rc $?" >> $O/summary.txt
  done
done
PYTHONPATH=$PWD/src python lab/rounds/ab_table.py $O xtail $BASE $CAND >> $O/summary.txt 2>&1
export PYTHONPATH=$PWD/src
timeout ${TEST_TIMEOUT:-330} python -m pytest -q -p no:cacheprovider -m gpu -n $NX ${TESTS_K:+-k "$TESTS_K"} $TESTS > $O/tests.log 2>&1
{ echo "## pytest -m gpu $TESTS"; grep -E "passed|failed|FAILED|ERROR" $O/tests.log | tail -n 15; } >> $O/summary.txt
cat $O/summary.txt
