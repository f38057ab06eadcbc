#!/usr/bin/env bash
# One device call: GPU tests of the nn / rotation / decode / HF paths, the rotated decode step's cost, the step
# profile, and first use of an 8B model. Logs under $OUT (a tarball plus summary.txt; the tool returns <= 8 files).
#   Device tool: run(command="bash lab/rounds/round_rotation.sh", timeout_s=600)     PART=tests|checks|all
set -u
R=$OUT; OUT=/tmp/round-out; mkdir -p $OUT
trap 'tar czf $R/logs.tgz -C $OUT . ; cp $OUT/summary.txt $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/summary.txt
PART=${PART:-all}
step() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  echo "## $name" >> $OUT/summary.txt
  local t=$SECONDS
  timeout $limit "$@" > $OUT/$name.log 2>&1; echo "rc $? in $((SECONDS - t)) s" >> $OUT/summary.txt
  tail -n ${TAIL:-25} $OUT/$name.log >> $OUT/summary.txt
}
if [ "$PART" != checks ]; then
  TAIL=12 step tests ${TEST_LIMIT:-240} python -m pytest -q -p no:cacheprovider -m gpu -n ${XDIST:-8} \
    ${TESTS:-tests/test_nn_linear.py tests/test_rotation_linear.py tests/test_rotation_moe.py tests/test_rotation_hf.py \
    tests/test_glue_rotation.py tests/test_hadamard_decode.py tests/test_hadamard.py tests/test_decode.py \
    tests/test_prologue.py tests/test_hf_quantizer.py tests/test_generate.py tests/test_step_profile.py \
    tests/test_calibrate.py tests/test_glue.py}
fi
if [ "$PART" != tests ]; then
  TAIL=30 step rotation_cost 170 python lab/rotation_step_cost.py --out $OUT
  TAIL=40 step step_profile 150 bash -c "${STEPPROF:-echo no step profile command}"
  TAIL=14 step first_use 200 python lab/first_use.py --out $OUT
fi
cat $OUT/summary.txt
