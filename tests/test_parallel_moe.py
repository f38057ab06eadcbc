"""kbit.parallel expert parallel: ``ExpertParallelKbitMoE`` on 2 processes (gloo on the CPU; NCCL marked gpu) against
the unsharded ``KbitMoE`` and the float64 reference, at odd E, top-k and H; ``parallelize_kbit`` with an ``"ep"``
style; a CUDA-graph capture of the step on 2 GPUs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import kbit
from kbit.dispatch.moe import MoePlan
from kbit.format.reference import dequantize_reference
from kbit.nn import KbitLinear, KbitMoE
from kbit.ops.moe import moe_reference
from kbit.ops.moe_router import select_experts
from kbit.parallel import (
    QWEN3_MOE_PLAN,
    ColumnParallelKbitLinear,
    ExpertParallelKbitMoE,
    expert_range,
    localize_pairs,
    parallelize_kbit,
    shard_experts,
)
from ranks import device, spawn


@pytest.mark.parametrize("E, world, expect", [
    (7, 2, [(0, 4), (4, 7)]), (128, 2, [(0, 64), (64, 128)]), (5, 3, [(0, 2), (2, 4), (4, 5)]),
])
def test_expert_range(E, world, expect):
    assert [expert_range(E, r, world) for r in range(world)] == expect


def test_shard_experts_and_errors():
    torch.manual_seed(0)
    qw = kbit.quantize(torch.randn(5, 24, 40), k=3, blocksize=32)
    s = shard_experts(qw, 2, 5)
    assert s.shape == (3, 24, 40) and s.codes.data_ptr() != qw.codes[2:].data_ptr()
    assert torch.equal(dequantize_reference(s), dequantize_reference(qw)[2:5])
    with pytest.raises(ValueError, match=r"stop: expected an int in \[3, 5\]"):
        shard_experts(qw, 2, 6)
    with pytest.raises(TypeError, match="qw: expected a stacked KbitWeight"):
        shard_experts(qw[0], 0, 1)
    moe = KbitMoE.from_weights(qw[:2].to("cpu"), kbit.quantize(torch.randn(2, 40, 12), k=3, blocksize=32), 1)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ExpertParallelKbitMoE.from_moe(moe)


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 9), E=st.integers(2, 20), world=st.integers(1, 4), data=st.data())
def test_localize_pairs_fuzz(T, E, world, data):
    """Every rank's pairs: ids in range, the local pairs kept with their weights, every other pair weighted 0 and
    sent to an expert its token uses here (or local expert 0), so that a token's ids change only where a local
    pair starts; over the ranks each pair is counted once."""
    world = min(world, E)
    top_k = data.draw(st.integers(1, E))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, top_k, generator=g)
    total = torch.zeros(T, top_k)
    for rank in range(world):
        a, b = expert_range(E, rank, world)
        lw, lid = localize_pairs(w, ids, a, b)
        mine = (ids >= a) & (ids < b)
        assert lid.dtype == torch.int32 and bool(((lid >= 0) & (lid < b - a)).all())
        assert torch.equal(lid[mine], (ids - a)[mine]) and torch.equal(lw[mine], w[mine])
        assert bool((lw[~mine] == 0).all())
        for t in range(T):
            used = set((ids[t][mine[t]] - a).tolist()) or {0}
            assert set(lid[t].tolist()) <= used
            runs = [s for s in range(1, top_k) if lid[t, s] != lid[t, s - 1]]
            assert all(mine[t, s] for s in runs)  # each run opens at a local pair: no expert read twice
        total += lw
    assert torch.equal(total, w)


def _stacks(E, H, I, g):
    return torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5


#: (E, H, I, top_k, T, dtype, plan, options): odd E (uneven expert ranges), padded H and I, a top_k above one
#: rank's expert count, the sigmoid router with groups, a shared expert, the fused router (fp16 GEMV steps), a
#: gate_up stack quantized under a Hadamard rotation of H
CASES = [
    (7, 72, 40, 3, 5, torch.float32, None, {}),
    (5, 64, 48, 4, 3, torch.float32, None, {"norm_topk_prob": False}),
    (8, 40, 36, 3, 6, torch.float32, None, {"router": "sigmoid", "n_group": 2, "topk_group": 1,
                                            "routed_scaling_factor": 2.0, "shared": True}),
    (6, 64, 32, 2, 1, torch.float16, MoePlan("gemv", "gemv"), {"router_weight": True}),
    (9, 64, 32, 2, 4, torch.float16, MoePlan("gemv", "gemv"), {}),
    (6, 64, 32, 2, 3, torch.float32, None, {"rotation": "hadamard"}),
]


def _case_module(case, g, device):
    E, H, I, top_k, T, dtype, plan, opts = case
    opts = dict(opts)
    kw = {}
    if opts.pop("shared", False):
        kw["shared_expert"] = nn.Sequential(nn.Linear(H, 16, bias=False), nn.SiLU(), nn.Linear(16, H)).to(dtype)
        kw["shared_expert_gate"] = nn.Linear(H, 1, bias=False).to(dtype)
    if opts.get("router") == "sigmoid":
        kw["correction_bias"] = torch.randn(E, generator=g) * 0.1
    if opts.pop("router_weight", False):
        kw["router_weight"] = torch.randn(E, H, generator=g)
    moe = KbitMoE.from_float(*_stacks(E, H, I, g), top_k=top_k, k=4, dtype=dtype, **opts, **kw)
    return moe.to(device)


def _check_ep(rank, world, backend, rtol):
    dev = device(backend)
    for i, case in enumerate(CASES):
        E, H, I, top_k, T, dtype, plan, opts = case
        if backend == "nccl" and dtype == torch.float32:
            dtype = torch.bfloat16
            case = (E, H, I, top_k, T, dtype, None, opts)
        g = torch.Generator().manual_seed(100 + i)  # the same block and inputs on every rank
        moe = _case_module(case, g, dev)
        x = torch.randn(T, H, generator=g).to(dev, dtype)
        logits = None if opts.get("router_weight") else torch.randn(T, E, generator=g).to(dev)
        with torch.no_grad():
            want = moe(x, logits, plan=plan).double().cpu()
            lg = logits if logits is not None else nn.functional.linear(x, moe.router_weight.to(x.dtype))
            w, ids = select_experts(lg, top_k,
                                    router=moe.router, renormalize=moe.norm_topk_prob,
                                    correction_bias=moe.correction_bias, n_group=moe.n_group,
                                    topk_group=moe.topk_group, scaling=moe.routed_scaling_factor)
            ref = moe_reference(x.cpu(), w.cpu(), ids.cpu(), dequantize_reference(moe.gate_up_weight().cpu()),
                                dequantize_reference(moe.down_weight().cpu()))
            if moe.shared_expert is not None:
                ref = ref + (torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)).double().cpu()
            ep = ExpertParallelKbitMoE.from_moe(moe, group=None)
            a, b = expert_range(E, rank, world)
            assert (ep.start, ep.stop, ep.local.num_experts, ep.top_k) == (a, b, b - a, top_k)
            got = ep(x.unsqueeze(0), logits, plan=plan).squeeze(0).double().cpu()
        scale = ref.abs().max().item()
        e_one = (want - ref).abs().max().item() / scale
        e_ep = (got - ref).abs().max().item() / scale
        # EP rounds each rank's partial sum to the activation dtype before the all-reduce adds them: one rounding
        # more than the unsharded layer (float32: the tests' rtol)
        tol = e_one + (rtol if dtype == torch.float32 else 2 * torch.finfo(dtype).eps)
        assert e_ep <= tol, f"case {i} rank {rank}: EP error {e_ep:.2e}, one device {e_one:.2e}"
        assert (got - want).abs().max().item() / scale <= tol, f"case {i} rank {rank}"


def test_expert_parallel_two_ranks(tmp_path):
    spawn(tmp_path, _check_ep, "gloo", 1e-5)


def _check_localize(rank, world):
    qg = kbit.quantize(torch.randn(5, 64, 32), k=4)
    qd = kbit.quantize(torch.randn(5, 32, 32), k=4)
    ep = ExpertParallelKbitMoE.from_moe(KbitMoE.from_weights(qg, qd, 3, dtype=torch.float32))
    ids = torch.tensor([[4, 0, 1], [3, 4, 2], [2, 3, 4]], dtype=torch.int32)
    w = torch.tensor([[0.5, 0.3, 0.2]] * 3)
    lw, lid = ep.localize(w, ids)
    if rank == 0:  # experts 0:3; row 1's first local expert is 2 (slot 2); row 2's is 2 (slot 0)
        assert lid.tolist() == [[0, 0, 1], [2, 2, 2], [2, 2, 2]]
        assert torch.equal(lw, w * torch.tensor([[0, 1, 1], [0, 0, 1], [1, 0, 0]]))
    else:  # experts 3:5 as 0:2; row 0 has only expert 4 (slot 0)
        assert lid.tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1]]  # row 1's slot 2 takes slot 1's expert
        assert torch.equal(lw, w * torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]]))
    with pytest.raises(ValueError, match=r"router_logits: expected shape \(2, 5\)"):
        ep(torch.randn(2, 32), torch.randn(2, 4))
    with pytest.raises(ValueError, match="hidden: expected last dimension H = 32"):
        ep(torch.randn(2, 31), torch.randn(2, 5))
    with pytest.raises(ValueError, match=f"local: expected {3 - rank} experts .* got 4"):
        ExpertParallelKbitMoE(KbitMoE.from_weights(qg[:4], qd[:4], 2, dtype=torch.float32), 5, 3)


def test_localize_and_errors_two_ranks(tmp_path):
    spawn(tmp_path, _check_localize)


class _Attention(nn.Module):
    def __init__(self, hidden, width):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, width, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.o_proj(torch.sigmoid(self.q_proj(x)) * self.k_proj(x) + self.v_proj(x))


class _MoeBlock(nn.Module):
    def __init__(self, hidden, width, E, inter, top_k, g):
        super().__init__()
        self.self_attn = _Attention(hidden, width)
        gu, dn = _stacks(E, hidden, inter, g)
        self.mlp = KbitMoE.from_float(gu, dn, top_k=top_k, k=4, dtype=torch.float32,
                                      router_weight=torch.randn(E, hidden, generator=g))

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.mlp(x)


class _MoeModel(nn.Module):
    def __init__(self, g, hidden=96, width=64, E=7, inter=40, top_k=3, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(_MoeBlock(hidden, width, E, inter, top_k, g) for _ in range(layers))
        for name, m in list(self.named_modules()):
            if isinstance(m, nn.Linear):
                parent, _, child = name.rpartition(".")
                setattr(self.get_submodule(parent), child, KbitLinear.from_linear(m, k=4, dtype=torch.float32))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _check_plan(rank, world):
    torch.manual_seed(5)
    model = _MoeModel(torch.Generator().manual_seed(5))
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(x).double()
        replaced = parallelize_kbit(model, QWEN3_MOE_PLAN)
        assert replaced["layers.1.mlp"] == "ep" and len(replaced) == 10
        assert isinstance(model.layers[0].mlp, ExpertParallelKbitMoE)
        assert isinstance(model.layers[0].self_attn.q_proj, ColumnParallelKbitLinear)
        got = model(x).double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"rank {rank}: TP + EP model differs from the unsharded one by {err:.2e}"


def test_parallelize_ep_plan_two_ranks(tmp_path):
    spawn(tmp_path, _check_plan)


def test_ep_style_needs_a_kbit_moe():
    lin = nn.Sequential()
    lin.add_module("mlp", KbitLinear(64, 64))
    with pytest.raises(TypeError, match="module 'mlp' .* expected a KbitMoE, got KbitLinear"):
        parallelize_kbit(lin, {"mlp": "ep"})


# -- 2 GPUs ---------------------------------------------------------------------------------------------------


def _check_graph(rank, world):
    """The EP step at decode sizes captured in a CUDA graph (no host sync) replays to the eager result."""
    dev = device("nccl")
    g = torch.Generator().manual_seed(3)
    E, H, I, top_k = 127, 1024, 384, 8  # odd E: 64 and 63 experts
    moe = KbitMoE.from_float(*_stacks(E, H, I, g), top_k=top_k, k=4, dtype=torch.bfloat16,
                             router_weight=torch.randn(E, H, generator=g)).to(dev)
    ep = ExpertParallelKbitMoE.from_moe(moe)
    for T in (1, 16):
        x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
        with torch.no_grad():
            want = moe(x).double()
            for _ in range(2):
                eager = ep(x)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                ep(x)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = ep(x)
            graph.replay()
            torch.cuda.synchronize()
        # the same kernels on the same inputs (a stream-K reduction may add in another order: not bit-exact)
        diff = ((out.double() - eager.double()).abs().max() / eager.double().abs().max()).item()
        assert diff < 1e-2, f"T={T} rank {rank}: graph replay differs from eager by {diff:.2e}"
        err = ((eager.double() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, f"T={T} rank {rank}: EP differs from one GPU by {err:.2e}"


@pytest.mark.gpu
def test_expert_parallel_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(tmp_path, _check_ep, "nccl", 2e-2, backend="nccl")


@pytest.mark.gpu
def test_expert_parallel_cuda_graph_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(tmp_path, _check_graph, backend="nccl")


@pytest.mark.gpu
def test_big_model_script_two_gpus():
    """lab/parallel/big_model.py at 2 layers: writes a sharded checkpoint per rank, loads it, decodes."""
    import os
    import shutil
    import subprocess

    if torch.cuda.device_count() < 2 or shutil.which("torchrun") is None:
        pytest.skip("needs 2 GPUs and torchrun")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))
    out = subprocess.run(["torchrun", "--nproc-per-node", "2", os.path.join(root, "lab/parallel/big_model.py"),
                          "--layers", "2", "--steps", "4"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("| yes |") == 2, out.stdout[-3000:]
