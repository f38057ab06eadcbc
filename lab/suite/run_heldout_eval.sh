#!/usr/bin/env bash
# GPU: the dispatcher with a tuned table (issue 32) on held-out shapes, in one bounded call (< 9.5 minutes of wall
# time): kbit bench on the suite's held-out half (shapes the tune half does not have, one per N x K band of the
# fitted rule: kbit.bench.suite.by_bands), M = 1, 16, 256, 1024, k = 4 then k = 2 as the budget allows, bf16
# cuBLAS, the read ceiling and humming in the same run; per point the dispatcher / fastest kbit candidate ratio.
#
#   Here, once: bash /work/shared/tools/fetch_peer_wheels.sh      (makes .whl/ in the repo root; git ignores it)
#   Device tool: run(command="bash lab/suite/run_heldout_eval.sh", carry=[".whl"], timeout_s=600)
#
# MS: the M list (default 1,16,256,1024); K4_BUDGET_S: the k = 4 part's budget (default 270 s); TOTAL_S: the
# whole run's (default 500 s; k = 2 runs on what k = 4 left).
# The table: on the machine that just ran lab/suite/run_tune_suite.sh, its table from /tmp/kbit-tune, installed as
# the user's table of the cache directory (it wins over a packaged one); else src/kbit/tuning/configs/tuned-<gpu>.json
# where the tree ships one. Without either the run goes on (the built-in rules) and says so. Written to $OUT: heldout-k4-*.json / -k2-*.json (results), their summaries,
# points-k4.md / points-k2.md (per point), run.log. Printed last: the per-point tables' closing lines.
set -uo pipefail
# KBIT_COMMIT: the commit the results name (the device copy's git data can be stale)
cd "$(dirname "$0")/../.."
T0=$(date +%s)
OUT=${OUT:-/tmp/heldout-out}
STATE=/tmp/kbit-tune
mkdir -p "$OUT" "$STATE/cubin"
PEERS=/tmp/kbit-peers
if compgen -G ".whl/humming*.whl" >/dev/null; then
  pip install -q --no-index --no-deps --target "$PEERS" .whl/humming*.whl 2>&1 | tail -2
else
  echo "no .whl/humming*.whl: humming rows will be skipped (run fetch_peer_wheels.sh here, carry .whl)" >&2
fi
export PYTHONPATH="$PEERS:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KBIT_CACHE_DIR="$STATE/cubin"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null || true
gpu=$(python -c "import torch; from kbit.tuning.tables import gpu_key; print(gpu_key(torch.device('cuda')))")
if [ -e "$STATE/tuned-$gpu.json" ]; then  # the user's table wins over a packaged one
  mkdir -p "$KBIT_CACHE_DIR/tuned" && cp "$STATE/tuned-$gpu.json" "$KBIT_CACHE_DIR/tuned/$gpu.json"
  echo "table: $STATE/tuned-$gpu.json (this machine's run_tune_suite.sh) installed as $KBIT_CACHE_DIR/tuned/$gpu.json"
elif [ -e "src/kbit/tuning/configs/tuned-$gpu.json" ]; then
  echo "table: packaged src/kbit/tuning/configs/tuned-$gpu.json"
else
  echo "table: NONE for $gpu (the dispatcher uses its built-in rules)"
fi
python -c "
from kbit.tuning import tuned; t = tuned.packaged_table('$gpu')
print('packaged table:', 'none' if t is None else f'{len(t.entries)} entries, {len(t.rules)} rules, commit {t.meta.get(\"commit\")}')"
PICK=$(python -c "
from kbit.bench import suite as S
from kbit.tuning.tuned import NK_EDGES
ms = S.load_models('models')
fam = S.shape_families(S.select(ms, split='held-out'))
print(','.join(f'{n}x{k}' for n, k in S.by_bands(S.unseen_shapes(ms), NK_EDGES, fam)[:6]))")
echo "held-out shapes: $PICK"
common=(--suite models --split held-out --suite-parts dense --pick "$PICK" --m "${MS:-1,16,256,1024}" --peers humming
        --out "$OUT")
timeout $(( ${K4_BUDGET_S:-270} + 60 )) python -m kbit.cli bench "${common[@]}" ${KBIT_COMMIT:+--commit "$KBIT_COMMIT"} --k 4 --budget-s "${K4_BUDGET_S:-270}" \
  --name heldout-k4 >"$OUT/run.log" 2>&1
echo "k=4 bench exit $? after $(( $(date +%s) - T0 )) s"
left=$(( ${TOTAL_S:-500} - ($(date +%s) - T0) ))
if [ "$left" -gt 90 ]; then  # k = 2 with what is left (the shapes largest first, as the bench orders them)
  timeout $(( left + 40 )) python -m kbit.cli bench "${common[@]}" ${KBIT_COMMIT:+--commit "$KBIT_COMMIT"} --k 2 --budget-s $(( left - 30 )) --no-ceiling \
    --name heldout-k2 >>"$OUT/run.log" 2>&1
  echo "k=2 bench exit $? after $(( $(date +%s) - T0 )) s"
fi
# results live in $OUT/<gpu>/; bring them up one level (the device tool returns at most 2 folders down, 8 files)
for f in "$OUT"/*/heldout-*; do [ -e "$f" ] && mv "$f" "$OUT/"; done
rm -f "$OUT"/heldout-*.csv "$OUT"/heldout-*.png "$OUT"/heldout-*[0-9].md  # keep the 8 files that come back useful
for kk in 4 2; do
  res=$(ls -t "$OUT"/heldout-k$kk-*.json 2>/dev/null | head -1)
  [ -n "$res" ] && python -m kbit.bench.dispatch_points "$res" >"$OUT/points-k$kk.md"
done
grep -E "budget|skip" "$OUT/run.log" | tail -n 5
for f in "$OUT"/points-k*.md; do [ -e "$f" ] && { echo "== $f"; tail -n 30 "$f"; }; done
cat "$OUT"/heldout-k4-*-summary.md 2>/dev/null | tail -n 8
echo "wall $(( $(date +%s) - T0 )) s"
