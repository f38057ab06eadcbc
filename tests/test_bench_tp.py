"""benchmarks/bench_tp.py's CPU smoke test: two gloo ranks, a tiny Llama (tensor parallel) and a tiny Qwen3-MoE
(attention tensor parallel, experts expert parallel), greedy tokens against one process, the result files."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_tp_tiny(tmp_path):
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(ROOT, "benchmarks", "bench_tp.py"), "--tiny", "--batch", "1,2", "--ctx", "8", "--steps", "4",
           "--reps", "1", "--out", str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "tp.json").read_text())
    assert [(r["model"], r["batch"]) for r in res["rows"]] == [
        ("llama-tiny", 1), ("llama-tiny", 2), ("qwen3moe-tiny", 1), ("qwen3moe-tiny", 2)]
    assert all(a["identical"] for a in res["meta"]["agreement"].values()), res["meta"]["agreement"]
    for b in res["meta"]["bytes"].values():
        assert b["rank_gib"] < 0.6 * b["whole_gib"]
    assert (tmp_path / "tp.md").read_text().startswith("# Tensor-parallel decode, cpu x 2")
