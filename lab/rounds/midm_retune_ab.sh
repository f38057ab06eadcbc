#!/bin/bash
# One device call (issues 32, 36): the tuned table with the M = 4, 8, 16 buckets measured again (after kernel 3's
# x-staging changes of 2026-11-28) against the table before, as shipped in two trees: new = ./src, base =
# .ab/base/src (git archive <rev> src | tar -x -C .ab/base; carry .ab and .whl).
#  1. the dispatcher on held-out dense shapes of >= 16M weights (every other one of the size order, SHAPES_EVERY),
#     k = KS (default 4), M = MS (default 4,8,16): base alone, then new with humming, bf16 and the read ceiling;
#  2. the whole decode step at batch BATCH (default 16), k = 4: new with bf16, then base without (E2E_TREES: which).
# Returned: $OUT/midm.tgz (logs, bench results, e2e tables), packed after each stage.
set -u
R=${OUT:-/tmp/out}; O=/tmp/midm; mkdir -p "$R" "$O"
pack() { tar czf "$R/midm.tgz" -C "$O" . ; }
T0=$(date +%s)
PEERS=/tmp/kbit-peers
pip install -q --no-index --no-deps --target "$PEERS" .whl/humming*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 KBIT_CACHE_DIR=/tmp/kbit-cache
C=${KBIT_COMMIT:-unknown}
PICK=$(PYTHONPATH=src python -c "
from kbit.bench import suite as S
s = [(n, k) for n, k in S.unseen_shapes(S.load_models('models')) if n * k >= 16_000_000]
print(','.join(f'{n}x{k}' for n, k in sorted(s, key=lambda t: -t[0] * t[1])[::${SHAPES_EVERY:-2}]))")
echo "shapes: $PICK"
for t in base new; do
  src=src; extra="--peers humming"; [ $t = base ] && { src=.ab/base/src; extra="--no-ceiling"; }
  PYTHONPATH="$PEERS:$PWD/$src" timeout ${T_BENCH:-150} python -m kbit.cli bench --shapes "$PICK" --m ${MS:-4,8,16} \
    --k ${KS:-4} --candidates kbit-linear --moe none $extra --commit "$C-$t" --out "$O/b" --name "midm-$t" \
    > "$O/bench-$t.log" 2>&1
  echo "bench $t rc $? after $(( $(date +%s) - T0 )) s"; pack
done
for t in ${E2E_TREES-new base}; do  # E2E_TREES= (empty): no e2e
  src=src; extra=""; [ $t = base ] && { src=.ab/base/src; extra="--skip-bf16"; }
  PYTHONPATH="$PWD/$src" timeout ${T_E2E:-200} python benchmarks/bench_e2e.py --models llama3-8b,qwen3-8b,qwen2.5-7b \
    --k 4 --batch ${BATCH:-16} --steps 16 --reps 3 --fuse-proj --no-kr --eager-steps 0 $extra --out "$O/e2e" \
    --name "e2e-b${BATCH:-16}-$t" > "$O/e2e-$t.log" 2>&1
  echo "e2e $t rc $? after $(( $(date +%s) - T0 )) s"; pack
done
