# Sourced by the suite's device scripts, from the repository root: humming from the carried wheel (.whl/) into
# /tmp/kbit-peers, PYTHONPATH to it and to src/, and the GPU's name printed.
PEERS=/tmp/kbit-peers
if compgen -G ".whl/humming*.whl" >/dev/null; then
  pip install -q --no-index --no-deps --target "$PEERS" .whl/humming*.whl 2>&1 | tail -2
else
  echo "no .whl/humming*.whl: humming rows will be skipped (run fetch_peer_wheels.sh here, carry .whl)" >&2
fi
export PYTHONPATH="$PEERS:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
