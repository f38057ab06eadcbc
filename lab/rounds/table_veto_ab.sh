#!/bin/bash
# One device call (issue 32): the nearest-shape pick without kernel-1 times carried to shapes where its CTAs take
# more tiles in turn (kbit.tuning.tuned._k1_more_rounds), with the shipped table's M = 1 entries refreshed from the
# 2026-11-27 quick retune (m1-retune-heldout-2026-11-27/tune-m1.json) two ways: only the entries whose shipped pick
# ran over 5% behind that run's best, or shapes it lacked ("stale"), or all 176 ("all"). Trees, each its own src
# with its packaged table (carry ".ab"):
#   .ab/base/src   the shipped code and table          ./src          the veto, the shipped table (working tree)
#   .ab/stale/src  the veto, the stale entries          .ab/all/src    the veto, all 176 entries
# Stage 1: the dispatcher at M = 1 on the held-out dense shapes of >= 16M weights, k = 2..5, a fresh process each,
# base / veto / stale / all. Stage 2 (STAGE=e2e): the whole step, batch 1, k = 4, base / stale / all twice.
# Returned: $OUT/table-veto.tgz, packed after each run.
set -u
export PYTHONUNBUFFERED=1
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
O=/tmp/table-veto; mkdir -p "$O"
pack() { tar czf "${OUT:-.}/table-veto.tgz" -C "$O" . ; }
export KBIT_CACHE_DIR=/tmp/kbit-cache
gpu=$(PYTHONPATH=$PWD/src python -c "import torch; from kbit.tuning.tables import gpu_key; print(gpu_key(torch.device('cuda')))")
rm -f "$KBIT_CACHE_DIR/tuned/$gpu.json"   # no user table: each tree's packaged table answers
tree() { case $1 in veto) echo "$PWD/src" ;; *) echo "$PWD/.ab/$1/src" ;; esac; }
T0=$(date +%s)
if [ "${STAGE:-heldout}" = heldout ]; then
  PICK=$(PYTHONPATH=$PWD/src python -c "
from kbit.bench import suite as S
print(','.join(f'{n}x{k}' for n, k in S.unseen_shapes(S.load_models('models')) if n * k >= 16_000_000))")
  i=0
  for t in ${ORDER:-base veto stale all}; do
    i=$((i + 1))
    PYTHONPATH=$(tree $t) timeout ${T_BENCH:-150} python -m kbit.cli bench --shapes "$PICK" --m 1 --k 2,3,4,5 \
      --candidates kbit-linear --no-ceiling --commit "$KBIT_COMMIT-$t" --out "$O" --name "heldout-$t$i" \
      > "$O/heldout-$t$i.log" 2>&1
    echo "heldout $t$i rc $? after $(( $(date +%s) - T0 )) s"
    pack
  done
  names=""; i=0; for t in ${ORDER:-base veto stale all}; do i=$((i + 1)); names="$names $t$i"; done
  python lab/suite/heldout_ab.py "$O" $names | tee "$O/heldout-ab.md"
  pack
else
  i=0
  for t in ${ORDER:-base stale all base stale all}; do
    i=$((i + 1))
    PYTHONPATH=$(tree $t) KBIT_COMMIT=$KBIT_COMMIT-$t timeout ${T_AB:-60} python benchmarks/bench_e2e.py \
      --models "${MODELS:-llama3-8b,qwen3-8b,qwen2.5-7b}" --k 4 --batch 1 --steps 16 --reps 3 --fuse-proj --no-kr \
      --skip-bf16 --eager-steps 0 --out "$O" --name "e2e-$t$i" > "$O/e2e-$t$i.log" 2>&1
    echo "e2e $t$i rc $? after $(( $(date +%s) - T0 )) s"
    grep -E "^\| [a-z]" "$O/e2e-$t$i.md" 2>/dev/null | cut -c1-60
    pack
  done
fi
