#!/bin/bash
# One device call (issue 36): 16-key chunks for the decode attention at context 512. The rule rounds a chunk up to
# whole 32-key blocks, so a target of 17 keys a split (33 splits of 544) runs as 17 splits of 32: half the programs it
# aimed at. Here the rule against 16-key chunks in 16-key blocks (1, 2, 4 warps) and 32-key chunks, two rounds.
# Logs and tables: $OUT/attn-b16.tgz.
set -u
export PYTHONUNBUFFERED=1
: "${KBIT_COMMIT:?set KBIT_COMMIT to the commit under test}"
export KBIT_COMMIT
O=/tmp/attn-b16
mkdir -p "$O"
PYTHONPATH=$PWD/src timeout ${T_SWEEP:-300} python lab/attn_chain_sweep.py --models ${MODELS:-qwen2.5-7b,qwen3-8b,llama3-8b} \
  --ctx 512 --batch 1,4 --configs 16/16/1/1,16/16/2/1,16/16/4/1,32/32/2/1 --rounds 2 --out "$O" > "$O/sweep.log" 2>&1
echo "rc $?"; grep -A70 "^{'gpu'" "$O/sweep.log" | cut -c1-120
tar czf "${OUT:-.}/attn-b16.tgz" -C "$O" .
