# Sourced by the round scripts (needs O, T0, KBIT_COMMIT and the script's pack function).
# e2e_trees ORDER MODELS BATCH T_AB COLS: the decode step of each tree of $ORDER (else the first argument; "new" is
# src, any other name .ab/<name>/src), a fresh benchmarks/bench_e2e.py process a run (k = 4, CUDA graphs,
# --fuse-proj --no-kr, no bf16), on $MODELS and $BATCH (else the arguments), each run cut at $T_AB s; prints each
# run's table rows cut at $COLS columns and packs the logs after each run. Run i of tree t writes e2e-<t><i>.*.
e2e_trees() {
  local i=0 t src
  for t in ${ORDER:-$1}; do
    i=$((i + 1))
    if [ "$t" = new ]; then src=$PWD/src; else src=$PWD/.ab/$t/src; fi
    PYTHONPATH=$src KBIT_COMMIT=$KBIT_COMMIT-$t timeout "${T_AB:-$4}" python benchmarks/bench_e2e.py \
      --models "${MODELS:-$2}" --k 4 --batch "${BATCH:-$3}" --steps 16 --reps 3 \
      --fuse-proj --no-kr --skip-bf16 --eager-steps 0 --out "$O" --name "e2e-$t$i" > "$O/e2e-$t$i.log" 2>&1
    echo "e2e $t$i rc $? after $(( $(date +%s) - T0 )) s"
    grep -E "^\| [a-z]" "$O/e2e-$t$i.md" 2>/dev/null | cut -c1-"${COLS:-$5}"
    pack
  done
}
