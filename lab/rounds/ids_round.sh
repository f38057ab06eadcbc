set -u
# One device call (2026-11-25): the GPU tests of the id checks and sampling, compute-sanitizer memcheck with bad ids,
# the id check cost A/B against 83ced6e (needs _trees/83ced6e: see lab/ab_trees.sh). Logs in $OUT.
R=$OUT; O=/tmp/ids-out; mkdir -p $O
trap 'tar czf $R/ids-logs.tgz -C $O . ; cp $O/summary.txt $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $O/summary.txt
PYTHONPATH=$PWD/src timeout 150 python -m pytest -q -p no:cacheprovider -n 8 tests/test_ids.py tests/test_sampling_edges.py tests/test_sampling.py tests/test_gemv.py -m gpu > $O/tests1.log 2>&1
PYTHONPATH=$PWD/src timeout 150 python -m pytest -q -p no:cacheprovider -n 3 tests/test_moe.py tests/test_grouped_mma.py -m gpu > $O/tests2.log 2>&1
{ echo "## tests"; tail -n 3 $O/tests1.log; tail -n 3 $O/tests2.log; } >> $O/summary.txt
PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=$PWD/src timeout 140 compute-sanitizer --tool memcheck --print-limit 20 python lab/sanitize_grouped.py > $O/sanitize.log 2>&1
{ echo "## sanitize rc $?"; tail -n 25 $O/sanitize.log; } >> $O/summary.txt
OUT=$O TREES="83ced6e . 83ced6e ." TAIL=8 timeout 120 bash lab/ab_trees.sh python -u lab/ids_cost.py > $O/ids_cost.txt 2>&1
{ echo "## ids_cost"; cat $O/ids_cost.txt; } >> $O/summary.txt
cat $O/summary.txt
