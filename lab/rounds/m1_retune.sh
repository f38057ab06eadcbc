set -u
# One device call (2026-11-27): the M = 1 points of the suite run (h100/suite-m1-2026-11-27/) where time fell as k
# grew (5120x8192 k = 2 -> 3, 9216x4096 k = 4 -> 5) or k = 5 lost most to humming (5120x17408), with 7680x5120 as a
# neighbour: `kbit tune` over kernels 1, 3, 4's configs (not --quick) at M = 1, k = 2..5, into a table of its own
# (not the shipped one), then the dispatcher on the same points. Tells whether a config of ours is monotonic in k.
#   Device tool: run(command="bash lab/rounds/m1_retune.sh", timeout_s=300)
R=$OUT; O=/tmp/m1rt; mkdir -p $O
trap 'cp $O/*.json $O/*.log $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
SH=${SHAPES:-9216x4096,5120x8192,5120x17408,7680x5120}
timeout 200 python -m kbit.cli tune --shapes $SH --k 2,3,4,5 --m 1 --kernels mma --budget-s 150 \
  --out $O/m1-retune.json > $O/tune.log 2>&1; echo "tune rc $?"
timeout 60 python -m kbit.cli bench --shapes $SH --k 2,3,4,5 --m 1 --candidates kbit-linear --no-ceiling \
  --out $O/b --name m1-disp > $O/bench.log 2>&1; echo "bench rc $?"; cp $O/b/*/m1-disp-*.json $O/ 2>/dev/null
python - $O <<'PY'
import json, sys, glob
o = sys.argv[1]
t = json.load(open(f"{o}/m1-retune.json"))["entries"]
disp = {}
for f in glob.glob(f"{o}/m1-disp-*.json"):
    for r in json.load(open(f))["rows"]:
        if r["kernel"] == "kbit-linear":
            disp[(r["N"], r["K"], r["k"])] = r["us"]
print("| shape | k | dispatcher us | tuned best us | best config |")
print("|---|--:|--:|--:|---|")
for k in sorted(t, key=int):
    for sh, ms in t[k].items():
        b = ms.get("1", {}).get("best")
        if b:
            n, kk = map(int, sh.split("x"))
            c = b["config"]
            cs = f"k{c['kernel']} w{c['warps']} c{c['min_ctas']} r{c.get('ring')} xs{int(bool(c.get('x_smem')))}"
            print(f"| {sh} | {k} | {disp.get((n, kk, int(k)), float('nan')):.2f} | {b['us']:.2f} | {cs} |")
PY
