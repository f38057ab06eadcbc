"""First use of an 8B model (issue 32): the wall time of its first forwards in a fresh process, with empty kernel
caches (NVRTC's CUBIN cache and Triton's), then in a second process with the caches the first one filled.

    python lab/first_use.py [--k 4] [--layers 32] [--out DIR]

Each process builds a Llama-3-8B-shaped model with random weights (``benchmarks/bench_e2e.build_kbit``, q/k/v and
gate/up fused, k bits), then times, each call synchronised: a 512-token prompt through the transformers forward, one
more token through it, and ``kbit.hf.decode.StaticDecoder`` (what ``kbit generate`` runs on CUDA: prefill of the
512 tokens, then the first CUDA-graph step, capture included). Building and quantizing are timed apart. Prints one
table; issue 32's bar: each first forward <= 60 s cold and <= 5 s from the caches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(k: int, layers: int) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    t0 = time.perf_counter()
    import torch
    from bench_e2e import build_kbit, configs

    from kbit.hf.decode import StaticDecoder

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, round(time.perf_counter() - t, 2)

    out = {"import_s": round(time.perf_counter() - t0, 2)}
    config = configs()["llama3-8b"]
    config.num_hidden_layers = layers
    (model, out["build_quantize_s"]) = timed(lambda: build_kbit(config, "cuda", k, fuse_proj=True).eval())
    ids = torch.randint(0, config.vocab_size, (1, 512), device="cuda")
    with torch.no_grad():
        res, out["forward_512_s"] = timed(lambda: model(ids, use_cache=True))
        _, out["forward_1_s"] = timed(lambda: model(ids[:, -1:], past_key_values=res.past_key_values,
                                                    use_cache=True))
        dec = StaticDecoder(model, 1, 600)
        _, out["static_prefill_512_s"] = timed(lambda: dec.prefill(ids))
        _, out["static_first_step_s"] = timed(dec.step)
        _, out["static_second_step_s"] = timed(dec.step)
        dec.release()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.k, a.layers)))
        return 0
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, KBIT_CACHE_DIR=f"{tmp}/kbit", TRITON_CACHE_DIR=f"{tmp}/triton",
                   PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        for run in ("cold", "warm"):
            t = time.perf_counter()
            r = subprocess.run([sys.executable, __file__, "--child", "--k", str(a.k), "--layers", str(a.layers)],
                               env=env, capture_output=True, text=True, timeout=500)
            if r.returncode != 0:
                print(r.stdout[-3000:], r.stderr[-3000:], sep="\n")
                return r.returncode
            rows[run] = json.loads(r.stdout.strip().splitlines()[-1])
            rows[run]["process_s"] = round(time.perf_counter() - t, 1)
    keys = list(rows["cold"])
    lines = [f"first use, Llama-3-8B-shaped, {a.layers} layers, k = {a.k} (seconds)",
             f"{'':<24}{'cold caches':>12}{'warm caches':>12}"]
    lines += [f"{key:<24}{rows['cold'][key]:>12}{rows['warm'][key]:>12}" for key in keys]
    print("\n".join(lines))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "first-use.json").write_text(json.dumps(rows, indent=1) + "\n")
        (Path(a.out) / "first-use.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
