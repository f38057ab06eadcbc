set -u
# One device call (2026-11-27): lab/rounds/t64_ab.py on every dense suite shape of >= 16M weights at k = 4, M = 1
# (T64 allowed / refused, two rounds each, one process; ran at 6c8dbdc: T64 is gone since 0672202, so the first half
# needs PYTHONPATH on such a tree), then lab/rounds/m1_retune.sh (the held-out points where
# M = 1 time fell as k grew). Device tool: run(command="bash lab/rounds/t64_round.sh", timeout_s=600)
R=$OUT; O=/tmp/t64; mkdir -p $O
trap 'cp $O/*.json $O/*.log $O/*.md $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout ${T64_S:-330} python lab/rounds/t64_ab.py -- --suite models --suite-parts dense --min-weights 16000000 \
  --m 1 --k 4 --no-ceiling --budget-s ${T64_BUDGET:-300} --out $O/b --name t64-ab > $O/t64-ab.log 2>&1
echo "t64 rc $?"; cp $O/b/*/t64-ab-*.json $O/b/*/t64-ab-*.md $O/ 2>/dev/null
res=$(ls $O/t64-ab-*.json 2>/dev/null | head -1)
[ -n "$res" ] && python lab/rounds/t64_table.py $res > $O/t64-table.md 2>&1
grep -ciE "skip|budget" $O/t64-ab.log
OUT=$O timeout 270 bash lab/rounds/m1_retune.sh > $O/m1-retune.log 2>&1
tail -n 25 $O/m1-retune.log
tail -n 3 $O/t64-table.md
