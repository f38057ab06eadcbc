#!/usr/bin/env bash
# One device call after merging a round of work: the GPU tests (two parts: the big MoE/layout files with fewer
# processes), then the checks each piece of work asked for, each only if its script exists. Logs under $OUT
# (a tarball plus the short summaries; the device tool returns at most 8 files).
#   Device tool: run(command="bash lab/gpu_round.sh", timeout_s=600)
#   PART=a|b|tests|checks|all (default all). On one H100 part a took 418 s and part b 114 s (2026-11-27), so the
#   two parts do not fit one 600 s call together: run PART=a, PART=b and PART=checks as separate calls.
set -u
R=$OUT; OUT=/tmp/round-out; mkdir -p $OUT
trap 'tar czf $R/logs.tgz -C $OUT . ; cp $OUT/summary.txt $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/summary.txt
PART=${PART:-all}
BIG="tests/test_moe.py tests/test_layout.py tests/test_grouped_mma.py"
if [ "$PART" = all ] || [ "$PART" = tests ] || [ "$PART" = a ]; then
  # twelve processes share one GPU's memory: on an 80 GB H100 the largest tests can run out of it together, so
  # part a's failures run once more one at a time (the summary shows both). -v names each test as it ends, so a
  # run cut by the time limit (a fresh machine compiles first: 2026-11-27 one stopped at 847 of 848) still names
  # its failures; they are rerun by name (pytest's --lf knows only runs that finished)
  timeout ${TEST_TIMEOUT:-480} python -m pytest -v -o cache_dir=/tmp/pytest-a -m gpu -n ${XDIST:-12} \
    --ignore=tests/test_moe.py --ignore=tests/test_layout.py --ignore=tests/test_grouped_mma.py > $OUT/tests-a.log 2>&1
  FAILS=$(grep -oE "(FAILED|ERROR) tests/[^ ]+" $OUT/tests-a.log | awk '{print $2}' | sort -u)
  if [ -n "$FAILS" ]; then
    # shellcheck disable=SC2086  # one argument a test id
    timeout ${RERUN_TIMEOUT:-300} python -m pytest -q -p no:cacheprovider -m gpu $FAILS > $OUT/tests-a-rerun.log 2>&1
  fi
  { echo "## pytest -m gpu, part a"; grep -cE " PASSED " $OUT/tests-a.log | sed 's/$/ PASSED lines/';
    grep -E "(FAILED|ERROR) tests/|passed|failed" $OUT/tests-a.log | grep -v "^\[gw" | tail -n 15;
    grep -oE "(FAILED|ERROR) tests/[^ ]+" $OUT/tests-a.log | sort -u | head -n 30;
    [ -f $OUT/tests-a-rerun.log ] && { echo "## part a's failures, one at a time";
      grep -E "passed|failed|FAILED|ERROR" $OUT/tests-a-rerun.log | tail -n 15; }; } >> $OUT/summary.txt
fi
if [ "$PART" = all ] || [ "$PART" = tests ] || [ "$PART" = b ]; then
  timeout ${TEST_TIMEOUT_B:-300} python -m pytest -q -p no:cacheprovider -m gpu -n ${XDIST_BIG:-3} $BIG \
    > $OUT/tests-b.log 2>&1
  { echo "## pytest -m gpu, part b"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests-b.log | tail -n 15; } \
    >> $OUT/summary.txt
fi
if [ "$PART" = all ] || [ "$PART" = checks ]; then
  run() {  # name, command...
    local name=$1; shift
    echo "## $name" >> $OUT/summary.txt
    timeout 150 "$@" > $OUT/$name.log 2>&1; echo "rc $?" >> $OUT/summary.txt
    tail -n 25 $OUT/$name.log >> $OUT/summary.txt
  }
  [ -f lab/sanitize_grouped.py ] && run sanitize compute-sanitizer --tool memcheck --error-exitcode 9 \
    python lab/sanitize_grouped.py
  [ -f lab/ids_cost.py ] && run ids_cost python lab/ids_cost.py
  [ -f lab/hadamard_speed.py ] && run hadamard_speed python lab/hadamard_speed.py --sweep --out $OUT
  run hf_gpu python -m pytest -q -p no:cacheprovider -m gpu -s tests/test_hf_quantizer.py tests/test_generate.py
fi
cat $OUT/summary.txt
