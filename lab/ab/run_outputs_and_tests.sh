#!/bin/bash
# Device run 1: bit-identical outputs of the old tree (.ab/old, the commit before the restructuring) and this
# tree, then the GPU test suite of this tree in parallel shards. Logs under $OUT.
set -u
R=$OUT; OUT=/tmp/ab-out; mkdir -p $OUT
trap 'tar czf $R/logs-outputs-tests.tgz -C $OUT . ; cp $OUT/outputs-compare.log $OUT/gpu-tests.log $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
S=${SHARDS:-6}
for i in $(seq 0 $((S - 1))); do
  python lab/ab/outputs.py --src $PWD/.ab/old/src --out /tmp/old-$i.pt --shard $i/$S > $OUT/outputs-old-$i.log 2>&1 &
  python lab/ab/outputs.py --src $PWD/src --out /tmp/new-$i.pt --shard $i/$S > $OUT/outputs-new-$i.log 2>&1 &
done
wait
tail -n 2 $OUT/outputs-*.log
python lab/ab/outputs.py --compare "/tmp/old-*.pt" "/tmp/new-*.pt" 2>&1 | tee $OUT/outputs-compare.log
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # the MoE and layout files hold layers of real models (up to ~20 GB each): fewer processes share the GPU there
  BIG="tests/test_moe.py tests/test_layout.py tests/test_grouped_mma.py"
  PYTHONPATH=$PWD/src timeout ${TEST_TIMEOUT:-420} python -m pytest -q -p no:cacheprovider -m gpu -n ${XDIST:-12} \
    --ignore=tests/test_moe.py --ignore=tests/test_layout.py \
    --ignore=tests/test_grouped_mma.py > $OUT/gpu-tests-a.log 2>&1
  PYTHONPATH=$PWD/src timeout ${TEST_TIMEOUT:-420} python -m pytest -q -p no:cacheprovider -m gpu -n ${XDIST_BIG:-3} \
    $BIG > $OUT/gpu-tests-b.log 2>&1
  { echo "# pytest -m gpu, two parts (the big MoE/layout files with fewer processes)"; tail -n 25 $OUT/gpu-tests-a.log;
    tail -n 25 $OUT/gpu-tests-b.log; } | tee $OUT/gpu-tests.log
fi
