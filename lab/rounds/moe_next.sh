#!/bin/bash
# One device call for the next MoE round (carry ".ab": .ab/base holds fc3920d's src): 1. .ab/comb = this tree with
# lab/patches/moe-pairs-combine.patch, its GPU tests (the combine launch, the pairs, the layer and graph tests);
# 2. the decode step, comb against src (ORDER), a fresh process a run; 3. lab/moe_silu_bound_lab.py in src (the
# SwiGLU bound on eight MoE shapes) and in .ab/base (the launch column: the router before its change).
# Logs: $OUT/moe-next.tgz.
set -u
export PYTHONUNBUFFERED=1
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
O=/tmp/moe-next; mkdir -p "$O" "${OUT:-.}"
pack() { tar czf "${OUT:-.}/moe-next.tgz" -C "$O" . ; }
T0=$(date +%s)
. "$(dirname "$0")/e2e_lib.sh"
rm -rf .ab/comb && mkdir -p .ab/comb && cp -r src tests lab .ab/comb/ \
  && (cd .ab/comb && patch -s -p1 < lab/patches/moe-pairs-combine.patch) > "$O/patch.log" 2>&1
echo "patch rc $?"; pack
(cd .ab/comb && PYTHONPATH=$PWD/src timeout ${T_TEST:-150} python -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_grouped_mma.py tests/test_moe.py -k "${TEST_K:-combine or pairs or graph or real_sizes or fused}" \
  > "$O/gpu-tests-comb.log" 2>&1)
echo "tests rc $? after $(( $(date +%s) - T0 )) s"; tail -3 "$O/gpu-tests-comb.log"; pack
e2e_trees "comb new comb new" qwen3-30b-a3b 1,2,4 90 70
for t in new base; do
  if [ $t = new ]; then src=$PWD/src; else src=$PWD/.ab/$t/src; fi
  mkdir -p "$O/lab-$t"
  PYTHONPATH=$src KBIT_COMMIT=$KBIT_COMMIT-$t timeout ${T_LAB:-120} python lab/moe_silu_bound_lab.py \
    --budget ${LAB_BUDGET:-90} --out "$O/lab-$t" > "$O/lab-$t.log" 2>&1
  echo "lab $t rc $? after $(( $(date +%s) - T0 )) s"; grep -A40 "^bound" "$O/lab-$t.log" | cut -c1-110; pack
done
