#!/bin/bash
# One device call: the dispatcher in source trees made on the device from the checkout's src plus a patch each,
# one fresh `kbit bench` process a run, in the order of RUNS (interleave them: base times moved up to 5% between
# device calls and within one, docs/notes/2026-11-29-m1-x-load-l2-prefetch.md). Then the table of the faster run of
# each tree over base's faster run, per (k, shape, M), and their geometric means.
#   Device tool: run(command="TREES='pf4=lab/patches/k3-l2-prefetch-lane-4.patch' RUNS='base pf4 base pf4' \
#                              bash lab/rounds/patch_ab.sh", timeout_s=600)
#   TREES: name=patch pairs (a patch from `git diff src`, applied with patch -p1 in a copy of src); "base" is src
#   RUNS (default: base, then each tree, then each tree again in reverse, then base), SH (shapes), KS, MS, TB
#   (seconds a run), TEST_TREE (a tree whose GPU tests run last: TESTS, default tests/test_gemv_mma.py, TT seconds)
# Returned: $OUT/patch-ab.tgz (runs' results and logs), $OUT/summary.txt.
set -u
R=${OUT:-/tmp/out}; O=/tmp/patchab; rm -rf "$O"; mkdir -p "$R" "$O/trees"  # a warm machine keeps /tmp: start clean
trap 'tar czf "$R/patch-ab.tgz" -C "$O" --exclude trees . ; cp "$O/summary.txt" "$R/" 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
names=""
for tp in ${TREES:-}; do
  n=${tp%%=*}; p=${tp#*=}; names="$names $n"
  rm -rf "$O/trees/$n"; mkdir -p "$O/trees/$n"; cp -r src "$O/trees/$n/"
  (cd "$O/trees/$n" && patch -s -p1 < "$OLDPWD/$p") || { echo "patch $p failed" | tee -a "$O/summary.txt"; exit 1; }
done
rev=$(for n in $names; do echo "$n"; done | tac | tr '\n' ' ')
RUNS=${RUNS:-base $names $rev base}
SH=${SH:-100352x5120,151936x4096,5120x32768,5376x21504,43008x5376,8192x5376,4096x14336}
i=0
for t in $RUNS; do
  i=$((i + 1))
  if [ "$t" = base ]; then src=$PWD/src; else src=$O/trees/$t/src; fi
  PYTHONPATH=$src timeout "${TB:-110}" python -m kbit.cli bench --shapes "$SH" --m "${MS:-1}" --k "${KS:-2,4}" \
    --candidates kbit-linear --no-ceiling --moe none --out "$O" --name "r$i-$t" > "$O/r$i-$t.log" 2>&1
  echo "run $i $t rc $?" >> "$O/summary.txt"
done
PYTHONPATH=$PWD/src python - "$O" >> "$O/summary.txt" <<'PY'
import glob, math, sys
from collections import defaultdict
from kbit.bench import report
t = defaultdict(lambda: defaultdict(list))
for f in sorted(glob.glob(f"{sys.argv[1]}/*/r*-*.json")):
    tree = f.rsplit("/", 1)[-1].split("-")[1]
    for r in report.read_results(f)[1]:
        if r["kernel"] == "kbit-linear":
            t[(r["k"], r["N"], r["K"], r["M"])][tree].append(r["us"])
trees = sorted({x for d in t.values() for x in d} - {"base"})
print("| k | N x K | M | base us (runs) | " + " | ".join(f"{x} / base" for x in trees) + " |")
print("|--:|---|--:|--:|" + "--:|" * len(trees))
logs = defaultdict(list)
for (k, N, K, M), d in sorted(t.items()):
    if not d.get("base"):
        continue
    b = min(d["base"])
    cells = []
    for x in trees:
        if d.get(x):
            logs[(k, x)].append(math.log(min(d[x]) / b))
        cells.append(f"{min(d[x]) / b:.3f}" if d.get(x) else "-")
    print(f"| {k} | {N}x{K} | {M} | {' / '.join(f'{v:.1f}' for v in d['base'])} | " + " | ".join(cells) + " |")
for (k, x), v in sorted(logs.items()):
    print(f"k = {k}, {x} / base: geometric mean {math.exp(sum(v) / len(v)):.3f}, range {math.exp(min(v)):.3f}-"
          f"{math.exp(max(v)):.3f} ({len(v)} points)")
PY
if [ -n "${TEST_TREE:-}" ]; then
  # -v names each test as it ends, so a run cut by the time limit still names its failures
  PYTHONPATH=$O/trees/$TEST_TREE/src timeout "${TT:-200}" python -m pytest -v -p no:cacheprovider -m gpu -n 8 \
    ${TESTS:-tests/test_gemv_mma.py} > "$O/tests-$TEST_TREE.log" 2>&1
  { echo "## GPU tests, $TEST_TREE"; grep -c " PASSED " "$O/tests-$TEST_TREE.log" | sed 's/$/ passed/';
    grep -oE "(FAILED|ERROR) tests/[^ ]+" "$O/tests-$TEST_TREE.log" | sort -u | head -n 20;
    tail -n 1 "$O/tests-$TEST_TREE.log"; } >> "$O/summary.txt"
fi
cat "$O/summary.txt"
