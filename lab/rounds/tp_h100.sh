set -u
# One device call on two GPUs (issue 37): the float32 / generate / parallel GPU tests, bench_tp (dense TP and MoE
# EP against one GPU and bf16), then the 235B-shaped capability run. Logs to $OUT; short summary last.
#   run(command="KBIT_COMMIT=<hash> bash lab/rounds/tp_h100.sh", kind="nvidia-h100-x2", timeout_s=600)
R=$OUT; O=/tmp/tp-out; mkdir -p $O
trap 'tar czf $R/tp-logs.tgz -C $O . ; cp $O/summary.txt $O/tp*.md $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader > $O/summary.txt
timeout ${TEST_TIMEOUT:-150} python -m pytest -q -p no:cacheprovider -m "${MARK:-gpu}" ${TESTS:-tests/test_nn_linear.py \
  tests/test_generate.py tests/test_parallel.py tests/test_tp_auto.py} > $O/tests.log 2>&1
{ echo "## tests"; grep -E "passed|failed|FAILED|ERROR" $O/tests.log | tail -n 12; } >> $O/summary.txt
timeout ${TP_TIMEOUT:-240} torchrun --nproc-per-node 2 benchmarks/bench_tp.py --models ${TP_MODELS:-llama3-8b,qwen3-30b-a3b} \
  --batch ${TP_BATCH:-1,16} --out $O/tp ${TP_ARGS:-} > $O/bench_tp.log 2>&1
{ echo "## bench_tp rc $?"; tail -n 14 $O/bench_tp.log; } >> $O/summary.txt
cp $O/tp/*.md $O/ 2>/dev/null
if [ "${BIG:-1}" = 1 ]; then
  timeout 200 torchrun --nproc-per-node 2 lab/parallel/big_model.py > $O/big_model.log 2>&1
  { echo "## big_model rc $?"; tail -n 12 $O/big_model.log; } >> $O/summary.txt
fi
cat $O/summary.txt
