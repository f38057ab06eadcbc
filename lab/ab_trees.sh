#!/bin/bash
# Same-run A/B of source trees: runs one command once a tree, with PYTHONPATH pointing at that tree's src.
# Trees are git archives unpacked beside the checkout (untracked, so the device tool carries them):
#   for c in e03b911 8b95df2; do mkdir -p _trees/$c && git archive $c src | tar -x -C _trees/$c; done
#   TREES="e03b911 8b95df2 ." bash lab/ab_trees.sh python -u -m kbit.cli bench --shapes 57344x8192 ...
# "." is the working tree. Each run's output goes to ${OUT:-.}/ab-<tree>-<i>.log; the last lines of each are
# printed. Remove _trees/ before committing.
D=${OUT:-.}
i=0
for t in $TREES; do
  i=$((i + 1))
  if [ "$t" = "." ]; then src=src; else src=_trees/$t/src; fi
  echo "== $i $t"
  PYTHONPATH=$src KBIT_COMMIT=$t "$@" > "$D/ab-$t-$i.log" 2>&1
  echo "rc $?"
  grep -E "^\| (kbit|bf16)" "$D/ab-$t-$i.log" | tail -n ${TAIL:-6}
done
