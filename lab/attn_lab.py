"""GPU lab (issue 6): the split-KV decode-attention kernel against static_attention's SDPA path.

    PYTHONUNBUFFERED=1 python lab/attn_lab.py [--batch 1,4,16,64] [--lengths 528,2048,8192] [--budget 110]
        [--out DIR]

Shapes: Llama-3-8B (Hq 32, Hkv 8, D 128) and Qwen3-30B-A3B (Hq 32, Hkv 4, D 128), bf16, at every batch and
valid length n; the cache holds Lmax = n rounded up to 16, + 16 positions, with StaticDecoder's mask
(0 for keys <= n - 1, the bf16 minimum after).

1. Correctness, per case: ``static_attention`` with the kernel and with ``KBIT_DECODE_ATTN=sdpa``, each against
   the float64 reference (max |error|; the kernel must be within max(2 x SDPA's error, 1/64)); the length-tensor
   form against the mask form; one CUDA graph replayed at several lengths against eager calls.
2. Cold-L2 timing (``kbit.bench.timing.time_calls``: one CUDA graph over K/V copies > 8 x L2, one call per copy,
   median of 15 replays): SDPA path, kernel with the mask (what the decoder runs), kernel with a length tensor.
   TB/s counts the valid K/V bytes (what the kernel reads); ``ms/step`` = saving x layers (32 / 48).
3. Config sweep (Llama shapes, B = 1 and 4): chunk / block_n alternatives to the default ``pick_config``.
4. Host overhead of one eager call (no graph), kernel vs SDPA.

Writes ``attn_lab.json`` / ``attn_lab.log`` under ``--out`` (default ``$OUT`` or "."), prints the tables last.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from kbit.bench.timing import capture, copies_for_cold_l2, l2_bytes, tbps, time_calls  # noqa: E402
from kbit.hf.decode import static_attention  # noqa: E402
from kbit.ops import attention as A  # noqa: E402

T0 = time.time()
MODELS = {"llama3-8b": (32, 8, 32), "qwen3-30b-a3b": (32, 4, 48)}  # Hq, Hkv, layers; D = 128
D = 128
DT = torch.bfloat16
DEV = "cuda"  # a CPU dry run of the script sets "cpu" (with TRITON_INTERPRET=1)
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.time() - T0:6.1f}s] {msg}"
    print(line, flush=True)
    LOG.append(line)


class Sdpa:
    """KBIT_DECODE_ATTN=sdpa inside the block (static_attention reads it at every call)."""

    def __enter__(self):
        self.saved = os.environ.get("KBIT_DECODE_ATTN")
        os.environ["KBIT_DECODE_ATTN"] = "sdpa"

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop("KBIT_DECODE_ATTN", None)
        else:
            os.environ["KBIT_DECODE_ATTN"] = self.saved


def make_case(B, Hq, Hkv, n, copies=1, seed=0):
    L = -(-n // 16) * 16 + 16
    g = torch.Generator(device=DEV).manual_seed(seed)
    query = torch.randn(B, 1, Hq, D, device=DEV, dtype=DT, generator=g).transpose(1, 2)  # as transformers
    kv = [(torch.randn(B, Hkv, L, D, device=DEV, dtype=DT, generator=g),
           torch.randn(B, Hkv, L, D, device=DEV, dtype=DT, generator=g)) for _ in range(copies)]
    allowed = torch.arange(L, device=DEV) <= n - 1
    mask = torch.where(allowed, torch.zeros((), dtype=DT, device=DEV), torch.finfo(DT).min)
    mask = mask.view(1, 1, 1, L).expand(B, 1, 1, L)
    return query, kv, mask, L


def attn(query, k, v, mask):
    return static_attention(None, query, k, v, mask, scaling=D ** -0.5)[0]


def reference(query, k, v, mask, Hkv):
    """float64 reference in batch slices (B = 64 at 8 K positions would need ~17 GB at once)."""
    B, Hq = query.shape[0], query.shape[1]
    qg = query.reshape(B, Hkv, Hq // Hkv, D)
    outs = [A.decode_attention_reference(qg[i:i + 8], k[i:i + 8], v[i:i + 8], mask=mask[i:i + 8],
                                         scale=D ** -0.5, out_dtype=torch.float64) for i in range(0, B, 8)]
    return torch.cat(outs).reshape(B, 1, Hq, D)


def check(model, B, n):
    Hq, Hkv, _ = MODELS[model]
    query, kv, mask, L = make_case(B, Hq, Hkv, n, seed=B * 7 + n)
    k, v = kv[0]
    ref = reference(query, k, v, mask, Hkv)
    out = attn(query, k, v, mask)
    with Sdpa():
        sd = attn(query, k, v, mask)
    qg = query.reshape(B, Hkv, Hq // Hkv, D)
    by_len = A.decode_attention(qg, k, v, length=torch.tensor([n], device=DEV))
    e_k = (out.double() - ref).abs().max().item()
    e_s = (sd.double() - ref).abs().max().item()
    e_ks = (out.double() - sd.double()).abs().max().item()
    e_len = (by_len.reshape(B, 1, Hq, D).double() - out.double()).abs().max().item()
    ok = math.isfinite(e_k) and e_k <= max(2 * e_s, 1 / 64) and e_len <= 1 / 64
    log(f"check {model} B={B} n={n} L={L}: |kbit-ref| {e_k:.2e} |sdpa-ref| {e_s:.2e} |kbit-sdpa| {e_ks:.2e} "
        f"|len-mask| {e_len:.2e} {'ok' if ok else 'FAIL'}")
    return {"model": model, "batch": B, "n": n, "L": L, "err_kbit": e_k, "err_sdpa": e_s, "err_kbit_sdpa": e_ks,
            "err_len_vs_mask": e_len, "ok": ok}


def graph_check():
    """One graph (length tensor and a mask made from it on the device), replayed at several lengths."""
    B, Hkv, G, L = 4, 8, 4, 2064
    q = torch.randn(B, Hkv, G, D, device=DEV, dtype=DT)
    k = torch.randn(B, Hkv, L, D, device=DEV, dtype=DT)
    v = torch.randn(B, Hkv, L, D, device=DEV, dtype=DT)
    n = torch.tensor([1], device=DEV)
    ar = torch.arange(L, device=DEV)

    def call():
        m = torch.where(ar < n, 0.0, torch.finfo(DT).min).to(DT).view(1, 1, 1, L).expand(B, 1, 1, L)
        return A.decode_attention(q, k, v, length=n), A.decode_attention(q, k, v, mask=m)

    graph, outs = capture(call)
    ok = True
    for length in (1, 63, 64, 65, 529, 2047, 2064, 7):
        n.fill_(length)
        graph.replay()
        eager = call()
        ok &= all(torch.equal(a, b) for a, b in zip(outs, eager, strict=True))
    log(f"graph replay at changing lengths == eager: {ok}")
    return ok


def timed(fn_per_copy, kv, reps=15):
    calls = [lambda k=k, v=v: fn_per_copy(k, v) for k, v in kv]
    return time_calls(calls, reps=reps)


def time_case(model, B, n, sweep=(), main=True):
    Hq, Hkv, layers = MODELS[model]
    L = -(-n // 16) * 16 + 16
    copies = copies_for_cold_l2(2 * B * Hkv * L * D * 2, l2_bytes())
    query, kv, mask, L = make_case(B, Hq, Hkv, n, copies=copies, seed=1)
    qg = query.reshape(B, Hkv, Hq // Hkv, D)
    length = torch.tensor([n], device=DEV)
    cfg = A.pick_config(B * Hkv, L, D, A.sm_count(query.device))
    row = {"model": model, "batch": B, "n": n, "L": L, "copies": copies, "chunk": cfg.chunk, "block_n": cfg.block_n,
           "splits": -(-L // cfg.chunk)}
    if main:
        with Sdpa():
            t_sdpa = timed(lambda k, v: attn(query, k, v, mask), kv)
        t_mask = timed(lambda k, v: attn(query, k, v, mask), kv)
        t_len = timed(lambda k, v: A.decode_attention(qg, k, v, length=length), kv)
        valid_bytes = 2 * B * Hkv * n * D * 2
        row.update({"sdpa_us": t_sdpa.us, "kbit_mask_us": t_mask.us, "kbit_len_us": t_len.us,
                    "sdpa_spread": [t_sdpa.us_min, t_sdpa.us_max], "kbit_mask_spread": [t_mask.us_min, t_mask.us_max],
                    "mode": t_mask.mode, "kbit_tbps": tbps(valid_bytes, t_mask.us),
                    "sdpa_tbps": tbps(valid_bytes, t_sdpa.us),
                    "ms_per_step_saved": (t_sdpa.us - t_mask.us) * layers / 1e3})
        log(f"time {model} B={B} n={n} L={L} x{copies}: sdpa {t_sdpa.us:.2f} us, kbit mask {t_mask.us:.2f} us, "
            f"len {t_len.us:.2f} us (chunk {cfg.chunk}/{cfg.block_n}, {row['splits']} splits) "
            f"{row['kbit_tbps']:.2f} TB/s, saves {row['ms_per_step_saved']:.3f} ms/step")
    else:
        log(f"sweep {model} B={B} n={n} L={L} x{copies} (default chunk {cfg.chunk}/{cfg.block_n})")
    sweeps = []
    for chunk, block_n, warps, stages in sweep:
        if time.time() - T0 > ARGS.budget:
            log("sweep skipped: budget")
            break
        c = A.DecodeAttentionConfig(chunk=chunk, block_n=block_n, num_warps=warps, num_stages=stages)
        t = timed(lambda k, v, c=c: A.decode_attention(qg, k, v, mask=mask, config=c), kv)
        t_len = timed(lambda k, v, c=c: A.decode_attention(qg, k, v, length=length, config=c), kv)
        sweeps.append({"model": model, "batch": B, "n": n, "L": L, "default_chunk": cfg.chunk,
                       "default_block_n": cfg.block_n, "chunk": chunk, "block_n": block_n,
                       "num_warps": warps, "num_stages": stages, "splits": -(-L // chunk), "us": t.us,
                       "len_us": t_len.us})
        log(f"  sweep chunk {chunk} block_n {block_n} warps {warps} stages {stages} ({-(-L // chunk)} splits): "
            f"mask {t.us:.2f} us, length {t_len.us:.2f} us")
    del kv
    torch.cuda.empty_cache()
    return row, sweeps


def host_overhead(reps=300):
    query, kv, mask, L = make_case(1, 32, 8, 528)
    k, v = kv[0]
    res = {}
    for name in ("kbit", "sdpa"):
        with Sdpa() if name == "sdpa" else contextlib.nullcontext():
            for _ in range(20):
                attn(query, k, v, mask)
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(reps // 5):
                    attn(query, k, v, mask)
                ts.append((time.perf_counter() - t0) / (reps // 5) * 1e6)
            torch.cuda.synchronize()
        res[name] = statistics.median(ts)
    log(f"host time per eager call: kbit {res['kbit']:.1f} us, sdpa {res['sdpa']:.1f} us")
    return res


def table(rows, sweeps, checks, graph_ok, host):
    lines = ["", f"correctness: {sum(c['ok'] for c in checks)}/{len(checks)} ok, graph replay "
             f"{'ok' if graph_ok else 'FAIL'}; worst |kbit-ref| {max(c['err_kbit'] for c in checks):.2e}, "
             f"|sdpa-ref| {max(c['err_sdpa'] for c in checks):.2e}",
             f"host per eager call: kbit {host.get('kbit', math.nan):.1f} us, sdpa {host.get('sdpa', math.nan):.1f} us",
             "", f"{'model':14} {'B':>3} {'n':>5} {'Lmax':>5} {'splits':>6} {'sdpa us':>8} {'kbit us':>8} "
             f"{'len us':>7} {'x':>5} {'TB/s':>5} {'ms/step':>7}"]
    for r in rows:
        lines.append(f"{r['model']:14} {r['batch']:>3} {r['n']:>5} {r['L']:>5} {r['splits']:>6} {r['sdpa_us']:>8.2f} "
                     f"{r['kbit_mask_us']:>8.2f} {r['kbit_len_us']:>7.2f} {r['sdpa_us'] / r['kbit_mask_us']:>5.2f} "
                     f"{r['kbit_tbps']:>5.2f} {r['ms_per_step_saved']:>7.3f}")
    if sweeps:  # the whole sweep is in the log and the JSON
        lines += ["", "sweep (llama3-8b; chunk/block_n/warps/stages, us with the mask | with a length tensor):"]
        cases = {}
        for s in sweeps:
            cases.setdefault((s["batch"], s["n"]), []).append(s)
        for (B, n), ss in cases.items():
            def name(s):
                return f"{s['chunk']}/{s['block_n']}/{s['num_warps']}/{s['num_stages']}"

            d = next((s for s in ss if (s["chunk"], s["block_n"], s["num_warps"], s["num_stages"])
                      == (s["default_chunk"], s["default_block_n"], 4, 2)), None)
            best = min(ss, key=lambda s: s["us"])
            best_len = min(ss, key=lambda s: s["len_us"])
            dflt = f"default {name(d)} {d['us']:.2f} | {d['len_us']:.2f}" if d else f"default {ss[0]['default_chunk']}"
            lines.append(f"B={B:<3} n={n:<5} {dflt}; best mask {name(best)} {best['us']:.2f}; best length "
                         f"{name(best_len)} {best_len['len_us']:.2f}")
    return "\n".join(lines)


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,4,16,64")
    ap.add_argument("--lengths", default="528,2048,8192")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budget", type=float, default=100.0, help="seconds; later parts are skipped past it")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ARGS = ap.parse_args()
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(x) for x in ARGS.batch.split(",")]
    lengths = [int(x) for x in ARGS.lengths.split(",")]
    models = ARGS.models.split(",")
    log(f"{torch.cuda.get_device_name()} ({A.sm_count(torch.device(DEV))} SMs), torch {torch.__version__}")
    res = {"meta": {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                    "argv": sys.argv[1:]}, "checks": [], "rows": [], "sweeps": []}

    def save():
        (out / "attn_lab.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        (out / "attn_lab.log").write_text("\n".join(LOG) + "\n")

    res["graph_ok"] = graph_check()
    for model in models:
        for B in batches:
            for n in lengths:
                res["checks"].append(check(model, B, n))
    save()
    for model in models:
        for B in batches:
            for n in lengths:
                if time.time() - T0 > ARGS.budget:
                    log(f"time {model} B={B} n={n}: skipped (budget)")
                    continue
                res["rows"].append(time_case(model, B, n)[0])
                save()
    sweep_cfgs = [(16, 16, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 4, 2), (256, 64, 4, 2),
                  (128, 64, 8, 2), (128, 64, 4, 1), (128, 64, 4, 3)]
    for B in (1, 4) if not ARGS.no_sweep and "llama3-8b" in models else ():
        for n in (lengths[0], lengths[-1]):
            if time.time() - T0 > ARGS.budget:
                log(f"sweep B={B} n={n}: skipped (budget)")
                continue
            res["sweeps"] += time_case("llama3-8b", B, n, sweep_cfgs, main=False)[1]
            save()
    res["host_us"] = host_overhead() if time.time() - T0 < ARGS.budget + 5 else {}
    text = table(res["rows"], res["sweeps"], res["checks"], res["graph_ok"], res["host_us"])
    LOG.append(text)
    save()
    print(text)


if __name__ == "__main__":
    main()
