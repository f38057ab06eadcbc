"""Record the MoE kernel choices of kbit at commit 64014d4 into tests/data/moe_plans.json.

The restructured MoE path (``kbit.dispatch.moe``, ``kbit.ops.grouped_mma``, ``kbit.tuning.moe``) must choose the
same kernels as the code it replaced; ``tests/test_moe_plans.py`` checks the new code against this file on the CPU.
The old tree is extracted with ``git archive`` and imported from a temporary folder; device facts (CUDA kernels
available, compute capability, whether ``torch._grouped_mm`` runs) are patched per GPU profile, and
``kbit.cuda.compile_kernel`` is replaced by a stub that records what would be compiled (no GPU needed).

Usage: ``python lab/moe_plan_fixture.py [--commit 64014d4] [--out tests/data/moe_plans.json]``
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import torch

#: GPU profiles: device string, CUDA kernels available, compute capability, torch._grouped_mm probe result
PROFILES = {
    "h100": ("cuda", True, (9, 0), True),
    "a100": ("cuda", True, (8, 0), True),
    "b200": ("cuda", True, (10, 0), True),
    "cpu": ("cpu", False, None, True),
    "cpu-nomm": ("cpu", False, None, False),
}
#: (E, top_k, H, I): real MoE layers and odd ones
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "qwen3-235b-a22b": (128, 8, 4096, 1536),
    "qwen3-next-80b": (512, 10, 2048, 512),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "mixtral-8x22b": (8, 2, 6144, 16384),
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "gpt-oss-120b": (128, 4, 2880, 2880),
    "deepseek-v3": (256, 8, 7168, 2048),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "olmoe": (64, 8, 2048, 1024),
    "odd-3x1": (3, 1, 100, 36),
    "odd-5x2": (5, 2, 200, 130),
    "odd-16x4": (16, 4, 520, 300),
    "odd-64x1": (64, 1, 64, 16),
    "odd-1x1": (1, 1, 256, 256),
}
TOKENS = [1, 2, 3, 4, 5, 8, 12, 16, 17, 24, 32, 48, 64, 96, 128, 200, 256, 384, 512, 768, 1024, 1025, 1536, 2048,
          3000, 4096, 6144, 8192]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: the block table / launch tables: S = 256-column segments of K
SEGMENTS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 23, 28, 56]
#: grouped kernel 7 configs: the three defaults and the ones the GPU tests force
WGMMA_CFGS = [(7, 16, 8, 4, 8, 1, 1), (7, 12, 16, 4, 8, 1, 1), (7, 8, 32, 4, 8, 1, 1), (7, 16, 8, 4, 8, 1, 2),
              (7, 12, 16, 4, 8, 1, 2), (7, 8, 32, 4, 8, 1, 2)]


def segments(K: int) -> int:
    return -(-K // 256)  # blocksize 32 divides 256: S = ceil(K / 256)


class FakeKernel:
    def __init__(self, file, name, defines):
        self.file, self.name, self.defines = file, name, dict(defines)
        self.shared = None

    def occupancy(self, block, shared=0):
        self.shared = shared
        return 1


def fake_compile(file, name, defines, device):
    return FakeKernel(file, name, defines)


def load_old(commit: str, root: str):
    """The kbit package of ``commit`` (``git archive`` of src into ``root``), imported fresh."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tar = subprocess.run(["git", "-C", repo, "archive", commit, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=tar, check=True)
    for name in [m for m in sys.modules if m == "kbit" or m.startswith("kbit.")]:
        del sys.modules[name]
    sys.path.insert(0, os.path.join(root, "src"))
    names = dict(cuda="kbit.cuda", mma="kbit.ops.gemv_mma", gr="kbit.ops.grouped_mma", moe="kbit.ops.moe",
                 nn="kbit.nn.moe")
    mods = SimpleNamespace(**{k: importlib.import_module(v) for k, v in names.items()})
    assert mods.gr.__file__.startswith(root), mods.gr.__file__
    return mods


def patch_profile(m, profile: str):
    """Device facts of ``profile`` in the old modules."""
    _, cuda, cap, probe = PROFILES[profile]
    m.gr.available = lambda device=None: cuda and torch.device(device or "cuda").type == "cuda"
    m.mma.available = m.gr.available
    m.mma.large_ok = lambda device: cap == (9, 0)
    m.moe._capability = lambda device: cap
    m.moe._grouped_mm_probe = lambda device, dtype: probe
    m.cuda.compile_kernel = fake_compile


def _plan_str(fn, *args, **kwargs) -> str:
    try:
        p = fn(*args, **kwargs)
    except ValueError:
        return "error"
    return f"{p.gate_up},{p.down}"


def route_label(m, T: int, plan) -> str:
    """Which routing the old ``KbitMoE.route`` builds for ``plan`` at ``T`` tokens (softmax router)."""
    labels = {}
    nn = m.nn
    saved = {n: getattr(nn, n) for n in ("align", "pair_order", "sort_pairs", "select_experts", "route_pairs")}
    nn.select_experts = lambda *a, **k: (None, None)
    nn.route_pairs = lambda *a, **k: (None, None, None, None)
    nn.align = lambda *a, **k: labels.setdefault("r", "align")
    nn.pair_order = lambda *a, **k: labels.setdefault("r", "pair_order")
    nn.sort_pairs = lambda *a, **k: labels.setdefault("r", "sort_pairs")
    try:
        me = SimpleNamespace(router="softmax", n_group=1, top_k=2, num_experts=8, norm_topk_prob=True,
                             correction_bias=None, topk_group=1, routed_scaling_factor=1.0, align_method="sort")
        nn.KbitMoE.route(me, torch.empty(T, 8, device="meta"), plan)
    finally:
        for n, f in saved.items():
            setattr(nn, n, f)
    return labels["r"]


def plan_entries(m, profile: str) -> dict:
    dev = PROFILES[profile][0]
    out = {}
    for sname, (E, top_k, H, I) in SHAPES.items():
        for T in TOKENS:
            for dname, dt in DTYPES.items():
                auto = _plan_str(m.moe.choose_plan, T, top_k, E, H, I, dt, dev)
                nogemm = _plan_str(m.moe.choose_plan, T, top_k, E, H, I, dt, dev, gemm=False)
                me = SimpleNamespace(plan=None, dtype=dt, gate_up_codes=SimpleNamespace(device=torch.device(dev)),
                                     layout="mma-v1", auto_repack=True, top_k=top_k, num_experts=E,
                                     hidden_size=H, intermediate_size=I)
                repacked = _plan_str(m.nn.KbitMoE.plan_for, me, T)
                me.layout, me.auto_repack = "canonical", False
                canonical = _plan_str(m.nn.KbitMoE.plan_for, me, T)
                out[f"{profile}|{sname}|{T}|{dname}"] = ";".join((auto, nogemm, repacked, canonical))
    return out


def grouped_entries(m, profile: str) -> dict:
    """Choices of the grouped tensor-core path (CUDA profiles): block rows, kernel per GEMM, kernel 7 and its
    config, tail split, fused SiLU, for rows unsorted and sorted."""
    dev = PROFILES[profile][0]
    out = {}
    rw = SimpleNamespace(layout="mma-v1")
    hidden = SimpleNamespace(device=torch.device(dev))
    for sname, (E, top_k, H, I) in SHAPES.items():
        for T in TOKENS:
            P = T * top_k
            large = m.gr._large_rows(P, E, dev)
            cfg = list(m.gr.large_config(P / max(1, min(E, P)))) if large else None
            rec = {"large": large, "cfg": cfg}
            for sort in (False, True):
                ng = m.gr.choose_ng(P, E, dev, sort)
                rec[f"ng{int(sort)}"] = ng
                rec[f"kern{int(sort)}"] = [m.gr._kernel(ng, segments(K)) for K in (H, I)]
            routing = SimpleNamespace(sorted=True, has_groups=True, P=P, E=E)
            rec["tail"] = m.moe._tail_split_rows(hidden, routing, rw, rw)
            gu = SimpleNamespace(stride=lambda d=None, I=I: (2 * I, 1) if d is None else (2 * I, 1)[d],
                                 data_ptr=lambda: 1 << 20, device=torch.device(dev))
            rec["silu"] = m.gr._fused_silu_ok(gu, P, E, None)
            out[f"{profile}|{sname}|{T}"] = rec
    return out


def route_entries(m) -> dict:
    out = {}
    plans = {"none": None, "gemv": m.moe.MoePlan("gemv", "gemv"), "gemm": m.moe.MoePlan("gemm", "gemm"),
             "gemv-gemm": m.moe.MoePlan("gemv", "gemm"), "grouped_mm": m.moe.MoePlan("grouped_mm", "grouped_mm")}
    for T in TOKENS:
        for name, plan in plans.items():
            out[f"{T}|{name}"] = route_label(m, T, plan)
    return out


def launch_entries(m) -> dict:
    """Kernels 1 / 4 (``_plan``) and kernel 7 (``large_defines`` + the grouped launcher's defines): what is
    compiled, warps, dynamic shared bytes."""
    out = {}
    for k in (2, 3, 4, 5):
        for sf in ("log8", "fp16"):
            for bf16 in (False, True):
                for ng in (1, 2, 4, 8):
                    for S in SEGMENTS:
                        kern, W, shared, _, defines = m.gr._plan(k, ng, S, sf, bf16, "cuda")
                        out[f"{k}|{sf}|{int(bf16)}|{ng}|{S}"] = [kern.file, kern.name, W, shared,
                                                                  dict(sorted(kern.defines.items()))]
                for cfg in WGMMA_CFGS:
                    defines, shared = m.mma.large_defines(k, cfg, grouped=True)
                    defines.update(BF16=int(bf16), FP16_SCALES=int(sf == "fp16"))
                    out[f"{k}|{sf}|{int(bf16)}|" + ",".join(map(str, cfg))] = [
                        "wgmma.cu", "kbit_wgmma", cfg[1], shared, dict(sorted(defines.items()))]
    return out


def record(m) -> dict:
    data = {"commit": None, "profiles": {k: [v[0], v[1], v[2], v[3]] for k, v in PROFILES.items()},
            "shapes": SHAPES, "tokens": TOKENS, "segments": SEGMENTS, "wgmma_cfgs": WGMMA_CFGS,
            "plans": {}, "grouped": {}}
    for profile in PROFILES:
        patch_profile(m, profile)
        data["plans"].update(plan_entries(m, profile))
        if PROFILES[profile][1]:
            data["grouped"].update(grouped_entries(m, profile))
    patch_profile(m, "h100")
    data["routes"] = route_entries(m)
    data["launch"] = launch_entries(m)
    return data


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default="64014d4")
    ap.add_argument("--out", default="tests/data/moe_plans.json")
    args = ap.parse_args()
    for var in [v for v in os.environ if v.startswith("KBIT_")]:
        del os.environ[var]  # the default path only
    with tempfile.TemporaryDirectory() as root:
        data = record(load_old(args.commit, root))
    data["commit"] = args.commit
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, separators=(",", ":"), sort_keys=True)
        f.write("\n")
    print(f"{args.out}: {len(data['plans'])} plans, {len(data['grouped'])} grouped, {len(data['launch'])} launches, "
          f"{os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
