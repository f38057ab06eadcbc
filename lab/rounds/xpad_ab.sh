#!/usr/bin/env bash
# GPU: lab/xpad_ab.py once a tree, alternating (ORDER, default "new base new base"): new = ./src, base = .ab/base/src
# (git archive <rev> src | tar -x -C .ab/base; carry .ab). Then the per-point ratio new / base of each config
# (the mean of each tree's runs). KS: k values (default 4).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/xpad}
mkdir -p "$OUT"
i=0
for t in ${ORDER:-new base new base}; do
  i=$((i + 1))
  src=src; [ "$t" = base ] && src=.ab/base/src
  PYTHONPATH=$src PYTHONUNBUFFERED=1 timeout ${T_RUN:-200} python lab/xpad_ab.py --k ${KS:-4} \
    --out "$OUT/xpad-$t-$i.json" > "$OUT/xpad-$t-$i.log" 2>&1
  echo "$t $i rc $?"
done
python - "$OUT" <<'PY'
import glob, json, sys, statistics as st
runs = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/xpad-*.json")):
    t = f.split("xpad-")[1].split("-")[0]
    for r in json.load(open(f))["results"]:
        key = (r["N"], r["K"], r["k"], r["M"])
        d = runs.setdefault(t, {}).setdefault(key, {})
        for n, v in [("dispatcher", r["dispatcher"])] + list(r["configs"].items()):
            if v:
                d.setdefault(n, []).append(v)
new, base = runs.get("new", {}), runs.get("base", {})
names = sorted({n for d in new.values() for n in d})
print("| shape | k | M | " + " | ".join(names) + " |")
print("|---|--:|--:|" + "--:|" * len(names))
for key in sorted(new):
    if key not in base:
        continue
    cells = []
    for n in names:
        a, b = new[key].get(n), base[key].get(n)
        cells.append(f"{st.mean(a) / st.mean(b):.3f}" if a and b else "-")
    print(f"| {key[0]}x{key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
PY
