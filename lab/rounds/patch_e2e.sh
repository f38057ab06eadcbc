#!/bin/bash
# One device call: patched trees against src in the decode step. 1. For the i-th file of PATCH (a space-separated
# list), .ab/<p, q, r or s> = src, tests and lab with that patch applied; the trees' GPU tests (TEST_FILES, TEST_K)
# side by side; 2. bench_e2e a fresh process a run in the order of ORDER (a tree's letter, or "new": src; MODELS,
# BATCH); 3. PROFILE=1: a step profile of tree p's first model at batch 1.
# Needs KBIT_COMMIT and PATCH. Logs: $OUT/patch-e2e.tgz.
set -u
export PYTHONUNBUFFERED=1
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
: "${PATCH:?set PATCH to the patch file (lab/patches/...)}"
O=/tmp/patch-e2e; mkdir -p "$O" "${OUT:-.}"
pack() { tar czf "${OUT:-.}/patch-e2e.tgz" -C "$O" . ; }
T0=$(date +%s)
. "$(dirname "$0")/e2e_lib.sh"
names=(p q r s); n=0
for f in $PATCH; do
  t=${names[$n]}; n=$((n + 1))
  rm -rf .ab/$t && mkdir -p .ab/$t && cp -r src tests lab .ab/$t/ && (cd .ab/$t && patch -s -p1 < "../../$f") \
    > "$O/patch-$t.log" 2>&1
  echo "patch $t ($f) rc $?"
  (cd .ab/$t && PYTHONPATH=$PWD/src timeout ${T_TEST:-200} python -m pytest -q -m gpu -p no:cacheprovider \
    -n ${XDIST:-4} ${TEST_FILES:-tests/test_moe.py tests/test_ids.py tests/test_decode.py} \
    -k "${TEST_K:-combine or add_norm or fast_step}" > "$O/gpu-tests-$t.log" 2>&1; echo "rc $?" >> "$O/gpu-tests-$t.log") &
done
wait; pack
for t in ${names[@]:0:$n}; do echo "tests $t: $(tail -2 "$O/gpu-tests-$t.log" | tr '\n' ' ')"; done
echo "tests after $(( $(date +%s) - T0 )) s"
e2e_trees "p new p new" qwen3-30b-a3b,mixtral-8x7b 1,4,16 100 70
if [ "${PROFILE:-0}" = 1 ]; then
  m=${MODELS:-qwen3-30b-a3b}; m=${m%%,*}
  PYTHONPATH=$PWD/.ab/p/src KBIT_COMMIT=$KBIT_COMMIT-p timeout ${T_PROF:-120} python benchmarks/bench_e2e.py \
    --models $m --k 4 --batch 1 --steps 16 --reps 3 --fuse-proj --no-kr --skip-bf16 --eager-steps 0 --profile \
    --layers ${PROF_LAYERS:-4} --out "$O" --name profile > "$O/profile.log" 2>&1
  echo "profile rc $? after $(( $(date +%s) - T0 )) s"; pack
fi
