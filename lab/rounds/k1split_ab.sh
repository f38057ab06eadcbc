set -u
# One device call (2026-11-27): the dispatcher at 79871de (before kernel 1's K-split rule) and in the working tree
# on the suite shapes whose kernel-1 plans the rule changes at M <= 16 (a CPU listing of the plans of both trees),
# two rounds a tree; then lab/huge_m1.py (the largest layers at M = 1, clocks sampled;
# HUGE=0 skips it) and, with CLOCK=1, lab/clock_warmup.py.
# Needs _trees/base = 79871de (git archive 79871de src | tar -x -C _trees/base) with the working tree's
# kbit/bench/timing.py copied in, so that both trees time alike.
R=$OUT; O=/tmp/k1-out; mkdir -p $O
trap 'tar czf $R/k1split-logs.tgz -C $O . ; cp $O/summary.txt $R/ 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $O/summary.txt
SH=${SHAPES:-5120x8192,2048x4096,1536x7168,5120x17408}
for i in 1 2; do
  for t in base head; do
    if [ $t = head ]; then src=$PWD/src; c=$(git rev-parse --short HEAD 2>/dev/null || echo head); else src=$PWD/_trees/base/src; c=79871de; fi
    PYTHONPATH=$src timeout 200 python -m kbit.cli bench --shapes $SH --k 2,3,4,5 --m 1,2,4,8,16 \
      --candidates kbit-linear --no-ceiling --commit $c --out $O/$t-$i --name k1split > $O/bench-$t-$i.log 2>&1
    echo "bench $t $i rc $?" >> $O/summary.txt
  done
done
PYTHONPATH=$PWD/src python lab/rounds/ab_table.py $O k1split 79871de >> $O/summary.txt 2>&1
if [ -f .whl/humming_kernels-0.1.19-cp310-abi3-manylinux_2_28_x86_64.whl ]; then
  pip install -q --no-index --no-deps --target /tmp/peers .whl/humming*.whl > /dev/null 2>&1
fi
if [ "${HUGE:-1}" = 1 ]; then
  PYTHONPATH=/tmp/peers:$PWD/src timeout 240 python lab/huge_m1.py > $O/huge_m1.log 2>&1
  { echo "## huge_m1 rc $?"; grep -E "^\||Error" $O/huge_m1.log | tail -n 50; } >> $O/summary.txt
fi
if [ "${CLOCK:-0}" = 1 ]; then  # lab/clock_warmup.py: the first timing after the GPU idled
  PYTHONPATH=$PWD/src timeout 200 python lab/clock_warmup.py > $O/clock_warmup.log 2>&1
  { echo "## clock_warmup rc $?"; grep -vE "^\|" $O/clock_warmup.log | tail -n 4; grep -E "^\|" $O/clock_warmup.log; } >> $O/summary.txt
fi
cat $O/summary.txt
