#!/usr/bin/env bash
# GPU: issue 32's M = 1 bars on every dense suite shape of >= 16M weights, k = 2..5, kbit's dispatcher against
# humming w2..w5, bf16 cuBLAS and the read ceiling in the same run. The 64 shapes (largest first) are cut in two
# halves, one device call each (< 10 minutes): PART=1 the larger 32, PART=2 the rest.
#
#   Here, once: bash /work/shared/tools/fetch_peer_wheels.sh      (makes .whl/ in the repo root; git ignores it)
#   Device tool: run(command="PART=1 KBIT_COMMIT=<rev> bash lab/suite/run_suite_m1.sh", carry=[".whl"])
# KS: the k values (default 2,3,4,5); BUDGET_S: kbit bench's budget (default 470 s). Both halves in one call (a
# subset of k fits): each into its own folder, then one tarball, since a call brings back at most 8 files:
#   R=$OUT; for p in 1 2; do OUT=/tmp/s$p PART=$p KS=4 BUDGET_S=240 bash lab/suite/run_suite_m1.sh; done;
#   tar czf $R/suite.tgz -C /tmp s1 s2
#
# Written to $OUT: suite-m1-p<PART>-<date>.{json,csv,md,png}, its -summary.md, run.log; then lab/suite/bars.py on it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/suite-out}
PART=${PART:-1}
mkdir -p "$OUT"
source lab/suite/peer_env.sh
PICK=$(python - "$PART" <<'PY'
import sys
from kbit.bench import suite as S
shapes = S.dense_shapes(S.select(min_weights=16e6))  # largest first
half = shapes[:32] if sys.argv[1] == "1" else shapes[32:]
print(",".join(f"{n}x{k}" for n, k in half))
PY
)
timeout 540 python -m kbit.cli bench ${KBIT_COMMIT:+--commit "$KBIT_COMMIT"} --suite models --suite-parts dense \
  --min-weights 16000000 --pick "$PICK" --m 1 --k ${KS:-2,3,4,5} --peers humming --candidates kbit-linear --budget-s ${BUDGET_S:-470} \
  --out "$OUT" --name "suite-m1${KS:+-k${KS//,/}}-p$PART" >"$OUT/run.log" 2>&1
rc=$?
for f in "$OUT"/*/suite-*; do [ -e "$f" ] && mv "$f" "$OUT/"; done
res=$(ls -t "$OUT"/suite-*.json 2>/dev/null | grep -v summary | head -1)
echo "kbit bench exit $rc; results: ${res:-none}"
grep -E "^Not measured|skipped|budget" "$OUT/run.log" | head -20
if [ -n "$res" ]; then
  python -m kbit.cli bench --summary "$res" > "${res%.json}-summary.md"
  python lab/suite/bars.py "$res"
fi
