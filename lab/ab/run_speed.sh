#!/bin/bash
# Device run 2: speed of the old tree (.ab/old) against this tree, alternating old, new, old, new: the README's
# M = 1 table (lab/ab/speed.py) and the Llama-3-8B-shaped decode step of benchmarks/bench_e2e.py at k = 4 and 2,
# batch 1. Prints the summary table last.
set -u
R=$OUT; OUT=/tmp/ab-speed; mkdir -p $OUT
trap 'tar czf $R/logs-speed.tgz -C $OUT . ; cp $OUT/ab-summary.md $OUT/m1.jsonl $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
ROUNDS=${ROUNDS:-3}
for r in $(seq $ROUNDS); do
  for t in old new; do
    src=$PWD/src; [ $t = old ] && src=$PWD/.ab/old/src
    python lab/ab/speed.py --src $src --tag $t --out $OUT/m1.jsonl > $OUT/m1-$t-$r.log 2>&1 || tail -5 $OUT/m1-$t-$r.log
  done
done
E2E=""
if [ "${SKIP_E2E:-0}" != 1 ]; then
  for r in $(seq $ROUNDS); do
    for t in old new; do
      root=$PWD; [ $t = old ] && root=$PWD/.ab/old
      python $root/benchmarks/bench_e2e.py --models llama3-8b --k 4,2 --batch 1 --skip-bf16 --eager-steps 0 \
        --out $OUT/e2e --name e2e-$t-$r > $OUT/e2e-$t-$r.log 2>&1 || tail -5 $OUT/e2e-$t-$r.log
      E2E="$E2E,$t=$OUT/e2e/e2e-$t-$r.json"
    done
  done
fi
python lab/ab/summary.py --m1 $OUT/m1.jsonl --e2e "${E2E#,}" | tee $OUT/ab-summary.md
