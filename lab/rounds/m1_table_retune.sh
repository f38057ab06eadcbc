#!/bin/bash
# One device call (issue 32): the shipped table's M = 1 entries tuned again with the quick space (kernel 3 at one CTA
# of 16 warps an SM joined it in 943eaff), merged into the shipped table (lab/suite/merge_tuned.py), then the
# dispatcher at M = 1 on the held-out dense shapes of >= 16M weights, k = 2..5, with the shipped table and with the
# merged one, fresh processes old then new; humming and the read ceiling in the new run. Two calls:
#   PHASE=tune KBIT_COMMIT=<rev> bash lab/rounds/m1_table_retune.sh                          (carry .whl)
#   PHASE=heldout NEW_TABLE=<merged table in the tree> KBIT_COMMIT=<rev> bash lab/rounds/m1_table_retune.sh
# Returned: $OUT/m1-table.tgz (tune log and table, the merged table, the bench results), packed after each stage.
# ORDER (default "old new"; alternate them, e.g. "old new new old", for an A/B), HUMMING=0: no peers in the new runs.
# MS (default 1) and KS (default 2,3,4,5) pick the M buckets and k: e.g. MS=4,8,16 KS=4 after kernel 3's x-staging
# changes of 2026-11-28 (docs/notes/2026-11-28-x-row-pad.md).
set -u
R=${OUT:-/tmp/out}; O=/tmp/m1tab; mkdir -p "$O"
pack() { tar czf "$R/m1-table.tgz" -C "$O" . ; }
T0=$(date +%s)
PEERS=/tmp/kbit-peers
pip install -q --no-index --no-deps --target "$PEERS" .whl/humming*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PEERS:$PWD/src" KBIT_CACHE_DIR=/tmp/kbit-cache
C=${KBIT_COMMIT:-unknown}
gpu=$(python -c "import torch; from kbit.tuning.tables import gpu_key; print(gpu_key(torch.device('cuda')))")
if [ "${PHASE:-tune}" = tune ]; then
timeout $(( ${BUDGET_S:-280} + 60 )) python -m kbit.bench.tune --commit "$C" --suite models --split tune --order bands \
  --quick --k ${KS:-2,3,4,5} --m ${MS:-1} --budget-s "${BUDGET_S:-280}" --out "$O/tune-m1.json" > "$O/tune.log" 2>&1
echo "tune rc $? after $(( $(date +%s) - T0 )) s"; grep -E "^budget|not stored|entries" "$O/tune.log" | tail -n 4
python lab/suite/merge_tuned.py --base "src/kbit/tuning/configs/tuned-$gpu.json" --new "$O/tune-m1.json" \
  --out "$O/tuned-$gpu.json" > "$O/merge.log" 2>&1; echo "merge rc $?"; tail -n 5 "$O/merge.log"
pack
exit 0
fi
PICK=$(python -c "
from kbit.bench import suite as S
print(','.join(f'{n}x{k}' for n, k in S.unseen_shapes(S.load_models('models')) if n * k >= 16_000_000))")
i=0
for t in ${ORDER:-old new}; do
  i=$((i + 1))
  mkdir -p "$KBIT_CACHE_DIR/tuned"
  if [ $t = new ]; then cp "$NEW_TABLE" "$KBIT_CACHE_DIR/tuned/$gpu.json"; extra="--peers humming"
  else rm -f "$KBIT_CACHE_DIR/tuned/$gpu.json"; extra="--no-ceiling"; fi
  [ "${HUMMING:-1}" = 0 ] && extra="--no-ceiling"
  timeout ${T_BENCH:-280} python -m kbit.cli bench --shapes "$PICK" --m ${MS:-1} --k ${KS:-2,3,4,5} \
    --candidates kbit-linear --moe none $extra \
    --commit "$C-$t" --out "$O/b" --name "m1-$t$i" > "$O/bench-$t$i.log" 2>&1
  echo "bench $t$i rc $? after $(( $(date +%s) - T0 )) s"
  pack
done
rm -f "$KBIT_CACHE_DIR/tuned/$gpu.json"
