set -u
# One device call (2026-11-25): the GPU tests touched by the validation work, then lab/hf_static_speed.py.
R=$OUT; O=/tmp/val-out; mkdir -p $O
trap 'tar czf $R/val-logs.tgz -C $O . ; cp $O/summary.txt $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader > $O/summary.txt
timeout 280 python -m pytest -q -p no:cacheprovider -n 12 -m gpu tests/test_validation.py tests/test_nn_linear.py tests/test_prologue.py tests/test_gemv.py tests/test_gemm.py tests/test_gemv_mma.py tests/test_dense_plans.py tests/test_tuned_dispatch.py tests/test_tune.py tests/test_suite.py tests/test_hadamard.py tests/test_serialize.py tests/test_decode.py tests/test_generate.py tests/test_hf.py tests/test_hf_quantizer.py tests/test_layout.py > $O/tests.log 2>&1
{ echo "## tests"; grep -E "passed|failed|FAILED|ERROR" $O/tests.log | tail -n 12; } >> $O/summary.txt
timeout 200 python lab/hf_static_speed.py --layers 8 --new 64 > $O/hf_static.log 2>&1
{ echo "## hf_static_speed rc $?"; tail -n 8 $O/hf_static.log; } >> $O/summary.txt
cat $O/summary.txt
