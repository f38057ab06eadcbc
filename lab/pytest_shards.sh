#!/bin/bash
# Run the tests that `pytest ARGS` selects in SHARDS (default 8) parallel pytest processes. The GPU tests are
# compile-bound (a process compiles each kernel variant it needs with NVRTC on the CPU, unless an earlier process
# left it in the on-disk cache, kbit.cuda.runtime.compile_cached), so shards cut the wall time on a many-core
# device machine. Writes one log a shard under ${LOGDIR:-$OUT} and prints each shard's summary.
# The shards share the GPU's memory: a test that allocates ~10 GB can fail with OutOfMemoryError beside 13 others
# (H100, 14 shards, test_grouped_mma); re-run such a failure on its own before reading it as a kernel bug.
#   bash lab/pytest_shards.sh tests/test_gemv_mma.py -m gpu
N=${SHARDS:-8}
D=${LOGDIR:-${OUT:-.}}
T=$(mktemp -d)
python -m pytest --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | grep "::" > "$T/ids"
echo "$(wc -l < "$T/ids") tests in $N shards"
split -n r/"$N" "$T/ids" "$T/shard_"
rc=0
for f in "$T"/shard_*; do
  python -m pytest -q -p no:cacheprovider $(cat "$f") > "$D/$(basename "$f").log" 2>&1 &
done
for job in $(jobs -p); do wait "$job" || rc=1; done
for f in "$T"/shard_*; do echo "$(basename "$f"): $(tail -n 1 "$D/$(basename "$f").log")"; done
grep -h -E "^(FAILED|ERROR)" "$D"/shard_*.log | head -20
exit $rc
