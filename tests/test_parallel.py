"""kbit.parallel: shards of a k-bit weight (bit-exact, no requantizing), column- / row-parallel layers and
``parallelize_kbit`` on 2 processes (gloo on the CPU; NCCL variants marked gpu), against the unsharded layer and a
float64 reference."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist
from torch import nn

import kbit
from kbit.format.reference import dequantize_reference
from kbit.nn import KbitLinear
from kbit.ops.allreduce import LamportBuffer, all_reduce_reference, lamport_all_reduce
from kbit.parallel import (
    ALLREDUCE_TABLE,
    LLAMA_PLAN,
    PACKED_LLAMA_PLAN,
    AllReduceConfig,
    ColumnParallelKbitLinear,
    RowParallelKbitLinear,
    all_reduce_sum,
    allreduce_config,
    choose_method,
    packed_ranges,
    parallelize_kbit,
    shard_range,
    shard_weight,
    split_rows,
)
from kbit.parallel.comm import symm_mem_missing
from ranks import device, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- shards, one process ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size, unit, world, expect", [
    (100, 16, 2, [(0, 64), (64, 100)]),
    (96, 16, 2, [(0, 48), (48, 96)]),
    (330, 32, 2, [(0, 192), (192, 330)]),
    (37, 16, 3, [(0, 16), (16, 32), (32, 37)]),
    (7, 1, 3, [(0, 3), (3, 5), (5, 7)]),
])
def test_shard_range(size, unit, world, expect):
    assert [shard_range(size, r, world, unit) for r in range(world)] == expect


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("blocksize", [32, 64, 128])
@pytest.mark.parametrize("scale_format", ["log8", "fp16"])
def test_shards_dequantize_to_slices(k, blocksize, scale_format):
    torch.manual_seed(k * blocksize)
    W = torch.randn(37, 300, dtype=torch.float64)  # odd N; K = 300 is padded for every blocksize
    qw = kbit.quantize(W, k=k, blocksize=blocksize, scale_format=scale_format)
    full = dequantize_reference(qw)
    for dim in (0, 1):
        units = -(-(37 if dim == 0 else 300) // (16 if dim == 0 else blocksize))
        for world in range(1, min(4, units) + 1):
            for rank in range(world):
                s = shard_weight(qw, dim, rank, world)
                a, b = shard_range(qw.shape[dim], rank, world, 16 if dim == 0 else blocksize)
                want = full[a:b] if dim == 0 else full[:, a:b]
                assert s.shape == tuple(want.shape)
                assert torch.equal(dequantize_reference(s), want), (dim, world, rank)
                assert s.tensor_scale is qw.tensor_scale  # one tensor scale: row-parallel partial sums add up


def test_shard_of_a_stack_and_padding_codes():
    torch.manual_seed(0)
    qw = kbit.quantize(torch.randn(3, 40, 100), k=3, blocksize=32)
    full = dequantize_reference(qw)
    s = shard_weight(qw, 1, 1, 2)  # columns 64:100 of every matrix, padded to 128
    assert s.shape == (3, 40, 36) and s.padded_k == 64
    assert torch.equal(dequantize_reference(s), full[..., 64:])
    # the padding codes travel with the last shard: a file of the shard passes the version-1 padding check
    from kbit.format.serialize import _check_padding
    _check_padding("w", s[0])


def test_shard_errors():
    qw = kbit.quantize(torch.randn(16, 64), k=4, blocksize=32)
    with pytest.raises(ValueError, match="size: expected at least 2 units of 16"):
        shard_weight(qw, 0, 0, 2)
    with pytest.raises(ValueError, match="dim: expected one of"):
        shard_weight(qw, 2, 0, 2)
    with pytest.raises(ValueError, match="unit: expected a multiple of the blocksize 32"):
        shard_weight(qw, 1, 0, 2, unit=16)
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 1\]"):
        shard_weight(qw, 1, 2, 2)
    with pytest.raises(TypeError, match="qw: expected a KbitWeight"):
        shard_weight(torch.zeros(2, 2), 0, 0, 1)


def test_shards_of_a_rotated_weight():
    """A column shard keeps the rotation (its rows still hold W R along all of K); a split of K is refused: the
    rotation spans every column and no shard could undo it."""
    qw = kbit.quantize(torch.randn(64, 128), k=4, rotation="hadamard", seed=3)
    shard = shard_weight(qw, 0, 1, 2)
    assert shard.rotation == qw.rotation
    torch.testing.assert_close(dequantize_reference(shard), dequantize_reference(qw)[32:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="qw: expected an unrotated weight for a split of K"):
        shard_weight(qw, 1, 0, 2)


def test_parallelize_errors():
    model = _stack(seed=0)
    with pytest.raises(ValueError, match=r"plan\['layers.\*.mlp.up_proj'\]: expected one of"):
        parallelize_kbit(model, {"layers.*.mlp.up_proj": "columnwise"})
    with pytest.raises(ValueError, match="plan: expected patterns matching at least one module"):
        parallelize_kbit(model, {"decoder.*.fc1": "colwise"})
    plain = nn.Sequential(nn.Linear(4, 4))  # a float layer: column styles only (a bf16 lm_head)
    with pytest.raises(TypeError, match="module '0' .* expected a KbitLinear, got Linear"):
        parallelize_kbit(plain, {"0": "rowwise"})
    with pytest.raises(TypeError, match="module '0' .* expected a KbitLinear, got Linear"):
        parallelize_kbit(plain, {"0": "packed_colwise"})
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            parallelize_kbit(model)


# -- 2 processes ----------------------------------------------------------------------------------------------


#: (N, K, blocksize): N not a multiple of 32 (uneven column shards), K padded, K split on block boundaries
SHAPES = [(100, 200, 32), (72, 300, 64), (50, 520, 128)]


def _check_layers(rank, world, backend, dtype, rtol):
    dev = device(backend)
    for k in (2, 3, 4, 5):
        for N, K, bs in SHAPES:
            g = torch.Generator().manual_seed(1000 * k + N)  # the same weights and inputs on every rank
            W, bias = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
            x = torch.randn(3, 5, K, generator=g, dtype=torch.float64)
            qw = kbit.quantize(W, k=k, blocksize=bs).to(dev)
            ref = x @ dequantize_reference(qw.cpu(), torch.float64).T + bias.double()
            lin = KbitLinear.from_weight(qw, bias, dtype)
            xd = x.to(dev, dtype)
            scale = ref.abs().max().item()

            def close(y, want, what, k=k, N=N, K=K, scale=scale):
                err = (y.double().cpu() - want).abs().max().item() / scale
                assert err < rtol, f"{what} k={k} N={N} K={K} rank={rank}: max error {err:.2e} of max |y|"

            col = ColumnParallelKbitLinear.from_linear(lin)
            a, b = col.start, col.stop
            close(col(xd), ref[..., a:b], "column")
            col.gather_output = True
            close(col(xd), ref, "column gathered")
            row = RowParallelKbitLinear.from_linear(lin, input_is_parallel=False)
            close(row(xd), ref, "row")
            row.input_is_parallel = True
            close(row(xd[..., row.start:row.stop]), ref, "row, parallel input")
            close(lin(xd), ref, "unsharded")


def test_layers_two_ranks(tmp_path):
    spawn(tmp_path, _check_layers, "gloo", torch.float32, 1e-5)


@pytest.mark.gpu
def test_layers_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(tmp_path, _check_layers, "nccl", torch.bfloat16, 2e-2, backend="nccl")


# a Llama-like stack with the module names of transformers' Llama (so LLAMA_PLAN applies)
class _Attention(nn.Module):
    def __init__(self, hidden, width):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, width, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(width, hidden, bias=True)

    def forward(self, x):  # column-local like per-head attention: every output column depends on its own q, k, v
        return self.o_proj(torch.sigmoid(self.q_proj(x)) * self.k_proj(x) + self.v_proj(x))


class _MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, hidden, width, inter):
        super().__init__()
        self.self_attn, self.mlp = _Attention(hidden, width), _MLP(hidden, inter)

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.mlp(x)


class _Stack(nn.Module):
    def __init__(self, hidden=200, width=160, inter=330, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(_Block(hidden, width, inter) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _stack(seed, dtype=torch.float32, device="cpu"):
    """The stack with every Linear replaced by a k = 4 KbitLinear (the same on every rank for a seed)."""
    torch.manual_seed(seed)
    model = _Stack()
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, KbitLinear.from_linear(m, k=4, blocksize=32, dtype=dtype))
    return model.to(device)


def _check_stack(rank, world, backend, dtype, rtol):
    dev = device(backend)
    model = _stack(seed=7, dtype=dtype, device=dev)
    x = torch.randn(2, 3, 200, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    with torch.no_grad():
        want = model(x).double().cpu()
        replaced = parallelize_kbit(model, LLAMA_PLAN)
        assert len(replaced) == 14 and replaced["layers.1.mlp.down_proj"] == "rowwise"
        assert isinstance(model.layers[0].self_attn.q_proj, ColumnParallelKbitLinear)
        assert model.layers[0].mlp.up_proj.stop - model.layers[0].mlp.up_proj.start == (192, 138)[rank]
        got = model(x).double().cpu()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < rtol, f"rank {rank}: parallel stack differs from the unsharded one by {err:.2e} of max |y|"


def test_llama_stack_two_ranks(tmp_path):
    spawn(tmp_path, _check_stack, "gloo", torch.float32, 1e-5)


@pytest.mark.gpu
def test_llama_stack_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(tmp_path, _check_stack, "nccl", torch.bfloat16, 3e-2, backend="nccl")


def _check_checkpoint(rank, world, path, x, want_up, want_down):
    weights = kbit.load_file(path)  # packed weights only: no rank holds a float weight
    up = ColumnParallelKbitLinear.from_weight(weights["mlp.up_proj.weight"], dtype=torch.float32, unit=32)
    down = RowParallelKbitLinear.from_weight(weights["mlp.down_proj.weight"], weights["mlp.down_proj.bias"],
                                             dtype=torch.float32, unit=32)
    del weights
    for m in (up, down):
        for name, t in m.named_buffers():
            assert not (t.is_floating_point() and t.numel() > 330), f"{name}: a float tensor of {t.numel()}"
    h = up(x)
    assert torch.allclose(h.double(), want_up[..., up.start:up.stop], rtol=1e-5, atol=1e-5)
    y = down(h)
    assert torch.allclose(y.double(), want_down, rtol=1e-5, atol=1e-4)


def test_shards_from_checkpoint(tmp_path):
    torch.manual_seed(3)
    qu = kbit.quantize(torch.randn(330, 200), k=3, blocksize=32)
    qd = kbit.quantize(torch.randn(200, 330), k=5, blocksize=32)
    bias = torch.randn(200)
    path = tmp_path / "model.kbit.safetensors"
    kbit.save_file({"mlp.up_proj.weight": qu, "mlp.down_proj.weight": qd, "mlp.down_proj.bias": bias}, path)
    x = torch.randn(4, 200)
    want_up = x.double() @ dequantize_reference(qu, torch.float64).T
    want_down = want_up.float().double() @ dequantize_reference(qd, torch.float64).T + bias.double()
    spawn(tmp_path, _check_checkpoint, str(path), x, want_up, want_down)


@pytest.mark.gpu
def test_tp_check_script():
    if torch.cuda.device_count() < 2 or shutil.which("torchrun") is None:
        pytest.skip("needs 2 GPUs and torchrun")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    out = subprocess.run(["torchrun", "--nproc-per-node", "2", os.path.join(ROOT, "lab/parallel/tp_check.py"),
                          "--layers", "2", "--no-timing"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "correct" in out.stdout


def _check_hf_llama(rank, world, dtype, rtol):
    from transformers import LlamaConfig, LlamaForCausalLM  # optional dependency

    from kbit.hf import quantize_model

    torch.manual_seed(11)  # the same model on every rank
    config = LlamaConfig(vocab_size=300, hidden_size=200, intermediate_size=330, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(dtype).eval()
    quantize_model(model, k=4, blocksize=32, progress=False)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits.double()
        # transformers' own plan for the model (patterns relative to the base model: matched on the name's end)
        replaced = parallelize_kbit(model, config.base_model_tp_plan)
        assert len(replaced) == 14
        assert model.model.layers[0].self_attn.k_proj.shard.out_features == 64  # one whole KV head a rank
        got = model(ids).logits.double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < rtol, f"rank {rank}: parallel Llama logits differ by {err:.2e} of max |logit|"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_hf_llama_two_ranks(tmp_path):
    pytest.importorskip("transformers")
    spawn(tmp_path, _check_hf_llama, torch.float32, 1e-4)


def _check_fast_decode_tp(rank, world):
    """kbit.hf.StaticDecoder's fast step (glue kernels, the interpreter on the CPU) on a model split by
    parallelize_kbit with the bf16-style float lm_head split by vocabulary: each rank's shards of q/k/v and gate/up
    are fused into one GEMV as on one device, and the greedy tokens and logits are the whole model's."""
    from transformers import LlamaConfig, LlamaForCausalLM  # optional dependency

    from kbit.hf import quantize_model
    from kbit.hf.decode import StaticDecoder
    from kbit.parallel import ColumnParallelLinear

    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    quantize_model(model, k=4, blocksize=32, progress=False)
    whole = copy.deepcopy(model)
    replaced = parallelize_kbit(model, {**config.base_model_tp_plan, "lm_head": "colwise_rep"})
    assert replaced["lm_head"] == "colwise_rep" and isinstance(model.lm_head, ColumnParallelLinear)
    assert model.lm_head.weight.shape == (model.lm_head.stop - model.lm_head.start, 256)
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(3))

    def run(m):
        dec = StaticDecoder(m, 2, 16, fast=True)
        toks, logits = [dec.prefill(ids).clone()], [dec.logits.clone()]
        for _ in range(4):
            toks.append(dec.step().clone())
            logits.append(dec.logits.clone())
        return dec, torch.stack(toks, 1), torch.stack(logits)

    _, want_t, want_l = run(whole)
    dec, got_t, got_l = run(model)
    assert all(f is not None for f in dec._fast.qkv + dec._fast.gate_up)  # one GEMV each on every rank
    assert dec._fast.qkv[0][0].out_features == (256 + 2 * 128) // world  # this rank's heads of q, k and v
    assert torch.equal(got_t, want_t)
    torch.testing.assert_close(got_l, want_l, atol=1e-4, rtol=1e-3)


def test_fast_decode_two_ranks(tmp_path):
    pytest.importorskip("transformers")
    spawn(tmp_path, _check_fast_decode_tp)


def _check_errors(rank, world):
    qw = kbit.quantize(torch.randn(100, 200, generator=torch.Generator().manual_seed(0)), k=4, blocksize=32)
    whole = KbitLinear.from_weight(qw, torch.zeros(100), torch.float32)
    with pytest.raises(ValueError, match=r"shard: expected out_features (64|36) \(rows (0:64|64:100) of 100"):
        ColumnParallelKbitLinear(whole, 100)
    with pytest.raises(ValueError, match="shard: expected a KbitLinear without bias"):
        RowParallelKbitLinear(whole, 200)
    with pytest.raises(ValueError, match=r"shard: expected in_features (128|72) \(columns"):
        RowParallelKbitLinear(KbitLinear.from_weight(qw, None, torch.float32), 200)
    with pytest.raises(TypeError, match="linear: expected a KbitLinear, got Linear"):
        ColumnParallelKbitLinear.from_linear(nn.Linear(4, 4))
    row = RowParallelKbitLinear.from_linear(whole, input_is_parallel=False)
    with pytest.raises(ValueError, match="x: expected last dimension 200 .the full input., got 72"):
        row(torch.randn(2, 72))


def test_layer_errors_two_ranks(tmp_path):
    spawn(tmp_path, _check_errors)


# -- packed weights (q/k/v, gate/up side by side) ---------------------------------------------------------------


def test_packed_ranges_and_shards():
    assert packed_ranges((64, 32), 1, 2, 16) == [(32, 64), (80, 96)]
    assert packed_ranges((100, 48, 48), 0, 2, 16) == [(0, 64), (100, 132), (148, 180)]
    torch.manual_seed(5)
    qw = kbit.quantize(torch.randn(100 + 48 + 48, 96), k=3, blocksize=32)
    full = dequantize_reference(qw)
    for rank in range(2):
        s = shard_weight(qw, 0, rank, 2, 16, parts=(100, 48, 48))
        want = torch.cat([full[a:b] for a, b in packed_ranges((100, 48, 48), rank, 2, 16)])
        assert torch.equal(dequantize_reference(s), want)
    members = split_rows(qw, (100, 48, 48))
    assert [m.shape for m in members] == [(100, 96), (48, 96), (48, 96)]
    assert torch.equal(torch.cat([dequantize_reference(m) for m in members]), full)
    with pytest.raises(ValueError, match=r"parts: expected row counts summing to N = 196, got \(100, 48\)"):
        shard_weight(qw, 0, 0, 2, parts=(100, 48))
    with pytest.raises(ValueError, match="parts: expected None for a split of K"):
        shard_weight(qw, 1, 0, 2, parts=(100, 48, 48))
    with pytest.raises(ValueError, match=r"parts\[1\]: expected an int in \[1, inf\], got 0"):
        packed_ranges((10, 0), 0, 1)
    with pytest.raises(ValueError, match="parts: expected row counts summing to N = 196"):
        split_rows(qw, (1, 2))


def _check_packed(rank, world, backend, dtype, rtol):
    dev = device(backend)
    torch.manual_seed(9)
    parts = (96, 32, 32)  # q, k, v widths: every part split on its own
    qw = kbit.quantize(torch.randn(sum(parts), 200), k=4, blocksize=32)
    bias = torch.randn(sum(parts))
    x = torch.randn(3, 200, dtype=torch.float64)
    ref = x @ dequantize_reference(qw, torch.float64).T + bias.double()
    lin = KbitLinear.from_weight(qw.to(dev), bias, dtype)
    lin.packed_parts = parts
    col = ColumnParallelKbitLinear.from_linear(lin, parts="packed")
    assert col.local_parts == [48, 16, 16] and col.ranges == packed_ranges(parts, rank, world, 16)
    xd = x.to(dev, dtype)
    y = col(xd).double().cpu()
    want = torch.cat([ref[:, a:b] for a, b in col.ranges], dim=-1)
    torch.testing.assert_close(y, want, rtol=rtol, atol=rtol * ref.abs().max().item())
    col.gather_output = True
    torch.testing.assert_close(col(xd).double().cpu(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())
    halves = ColumnParallelKbitLinear.from_linear(KbitLinear.from_weight(qw, None, torch.float32), parts="packed")
    assert halves.parts == (80, 80)
    with pytest.raises(ValueError, match="parts: expected None, 'packed' or a tuple"):
        ColumnParallelKbitLinear.from_linear(lin, parts="qkv")
    with pytest.raises(ValueError, match=r"parts: expected row counts summing to out_features = 160"):
        ColumnParallelKbitLinear(col.shard, 160, parts=(96, 32))


def test_packed_columns_two_ranks(tmp_path):
    spawn(tmp_path, _check_packed, "gloo", torch.float32, 1e-5)


@pytest.mark.gpu
def test_packed_columns_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(tmp_path, _check_packed, "nccl", torch.bfloat16, 2e-2, backend="nccl")


class _PackedBlock(nn.Module):
    """A block with q/k/v and gate/up packed (the names of PACKED_LLAMA_PLAN)."""

    def __init__(self, hidden=200, width=128, kv=64, inter=330):
        super().__init__()
        self.self_attn, self.mlp = nn.Module(), nn.Module()
        self.parts = (width, kv, kv)
        self.self_attn.qkv_proj = nn.Linear(hidden, width + 2 * kv, bias=False)
        self.self_attn.o_proj = nn.Linear(width, hidden, bias=True)
        self.mlp.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        a = self.self_attn
        parts = getattr(a.qkv_proj, "local_parts", None) or a.qkv_proj.packed_parts
        q, k, v = a.qkv_proj(x).split(list(parts), dim=-1)
        g = q.shape[-1] // k.shape[-1]  # query heads a KV head: whole heads on every rank
        x = x + a.o_proj(q * torch.sigmoid(k).repeat_interleave(g, -1) + v.repeat_interleave(g, -1))
        gate, up = self.mlp.gate_up_proj(x).chunk(2, dim=-1)
        return x + self.mlp.down_proj(nn.functional.silu(gate) * up)


def _check_packed_stack(rank, world):
    torch.manual_seed(4)
    model = nn.Sequential()
    model.layers = nn.ModuleList(_PackedBlock() for _ in range(2))
    for block in model.layers:
        for parent, name in ((block.self_attn, "qkv_proj"), (block.self_attn, "o_proj"), (block.mlp, "gate_up_proj"),
                             (block.mlp, "down_proj")):
            setattr(parent, name, KbitLinear.from_linear(getattr(parent, name), k=4, blocksize=32))
        block.self_attn.qkv_proj.packed_parts = block.parts
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(1))

    def run(m):
        y = x
        for block in m.layers:
            y = block(y)
        return y

    with torch.no_grad():
        want = run(model)
        replaced = parallelize_kbit(model, PACKED_LLAMA_PLAN)
        assert len(replaced) == 8 and replaced["layers.0.mlp.gate_up_proj"] == "packed_colwise"
        assert model.layers[0].mlp.gate_up_proj.local_parts == [(192, 138)[rank]] * 2
        got = run(model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_packed_stack_two_ranks(tmp_path):
    spawn(tmp_path, _check_packed_stack)


# -- the all-reduce: choice by message size, symmetric memory against NCCL -------------------------------------


def test_allreduce_config_choice():
    c = AllReduceConfig(one_shot_max_bytes=1024, two_shot_max_bytes=4096)
    assert [c.method(n) for n in (8, 1024, 1025, 4096, 4097)] == ["one_shot", "one_shot", "two_shot", "two_shot",
                                                                   "nccl"]
    assert c.buffer_bytes == 4096
    assert AllReduceConfig().method(1) == "nccl"
    assert AllReduceConfig(two_shot_max_bytes=100).method(50) == "two_shot"
    lam = AllReduceConfig(lamport_max_bytes=512, one_shot_max_bytes=1024)
    assert [lam.method(256), lam.method(256, torch.float32), lam.method(1000)] == ["lamport", "one_shot", "one_shot"]
    assert ALLREDUCE_TABLE[("h200", 2)].lamport_max_bytes > 0
    with pytest.raises(ValueError, match=r"lamport_max_bytes: expected an int in \[0, inf\], got -2"):
        AllReduceConfig(lamport_max_bytes=-2)
    with pytest.raises(ValueError, match="device: expected a CUDA device"):
        LamportBuffer(100, "cpu")
    with pytest.raises(ValueError, match=r"one_shot_max_bytes: expected an int in \[0, inf\], got -1"):
        AllReduceConfig(one_shot_max_bytes=-1)
    assert allreduce_config("cpu", 2) == AllReduceConfig()  # no symmetric memory off CUDA
    assert ALLREDUCE_TABLE[("generic", 2)].one_shot_max_bytes > 0
    with pytest.raises(ValueError, match="method: expected one of"):
        symm_mem_missing("ring")


def _check_allreduce_fallback(rank, world):
    y = torch.full((4, 100), float(rank + 1))
    eager = AllReduceConfig(lamport_max_bytes=1 << 10, one_shot_max_bytes=1 << 20, two_shot_max_bytes=1 << 21)
    assert choose_method(y, None, eager) == "nccl"  # gloo and CPU tensors: NCCL's path (the backend's all_reduce)
    assert choose_method(y.bfloat16(), None, eager) == "nccl"
    for method in (None, "one_shot", "two_shot", "lamport", "nccl"):
        out = all_reduce_sum(y.clone(), None, eager, method)
        assert torch.equal(out, torch.full((4, 100), 3.0)), method
    with pytest.raises(TypeError, match="y: expected a torch.Tensor, got list"):
        all_reduce_sum([1.0])
    row = RowParallelKbitLinear.from_weight(kbit.quantize(torch.randn(8, 64, generator=torch.Generator()
                                                                      .manual_seed(0)), k=4, blocksize=32),
                                            dtype=torch.float32)
    row.comm = eager
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    assert row(x).shape == (2, 8)
    # the un-reduced partial products add up to the layer's output (a caller may fuse that sum)
    part = row.partial(x)
    summed = part.clone()
    dist.all_reduce(summed)
    torch.testing.assert_close(summed, row(x), rtol=0, atol=0)
    assert not torch.equal(part, summed)


def test_allreduce_fallback_two_ranks(tmp_path):
    spawn(tmp_path, _check_allreduce_fallback)


def _check_symm(rank, world):
    dev = device("nccl")
    cfg = AllReduceConfig(one_shot_max_bytes=1 << 20, two_shot_max_bytes=1 << 21)
    # the table's choice at batch 1: Lamport where measured (h200), else one-shot
    assert choose_method(torch.empty(1, 4096, dtype=torch.bfloat16, device=dev)) in ("lamport", "one_shot")
    assert choose_method(torch.empty(1, 3, dtype=torch.bfloat16, device=dev), None, cfg) == "nccl"  # 6 bytes
    for shape, dtype in (((1, 4096), torch.bfloat16), ((64, 4096), torch.bfloat16), ((3, 100), torch.bfloat16),
                         ((5, 36), torch.float32), ((1, 3), torch.bfloat16)):
        g = torch.Generator(device=dev).manual_seed(100 * rank + shape[1])
        x = torch.randn(shape, device=dev, generator=g).to(dtype)
        want = x.clone()
        dist.all_reduce(want)
        for method in ("one_shot", "two_shot", "lamport"):
            got = all_reduce_sum(x.clone(), None, cfg, method)
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=f"{method} {shape} {dtype}")
            # in a CUDA graph: new data in the captured input, summed again
            static = x.clone()
            all_reduce_sum(static.clone(), None, cfg, method)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = all_reduce_sum(static, None, cfg, method)
            static.copy_(x * 2)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, want * 2, rtol=1e-2, atol=1e-2, msg=f"graph {method} {shape}")
    # a row-parallel layer: symmetric memory gives NCCL's result
    qw = kbit.quantize(torch.randn(4096, 1024, generator=torch.Generator().manual_seed(3)), k=4).to(dev)
    row = RowParallelKbitLinear.from_weight(qw, torch.randn(4096), input_is_parallel=False)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(4)).to(dev, torch.bfloat16)
    row.comm = AllReduceConfig()
    want = row(x)
    row.comm = cfg
    torch.testing.assert_close(row(x), want, rtol=1e-2, atol=1e-2)


def _check_lamport(rank, world):
    """The barrier-free all-reduce equals NCCL's bf16 sum bit for bit: sizes that change from call to call, -0.0 in
    the payload, and replays of a CUDA graph of several calls (the slots and call counters cycle on the device)."""
    dev = device("nccl")
    buf = LamportBuffer(64 * 4096, dev)
    sizes = [4096, 100, 64 * 4096, 8, 3 * 4096]
    for rep in range(3):
        for n in sizes:
            x = torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(rank * 1000 + n + rep))
            x = x.to(torch.bfloat16)
            x[::7] = -0.0
            assert torch.equal(lamport_all_reduce(x, buf), all_reduce_reference(x)), (n, rep)
    xs = [torch.zeros(n, dtype=torch.bfloat16, device=dev) for n in sizes]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [lamport_all_reduce(x, buf) for x in xs]
    for rep in range(4):
        for x in xs:
            x.copy_(torch.randn(x.numel(), device=dev, generator=torch.Generator(device=dev).manual_seed(
                rep * 7 + x.numel() + 100 * rank)).to(torch.bfloat16))
        wants = [all_reduce_reference(x) for x in xs]
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, w) for o, w in zip(outs, wants, strict=True)), rep
    with pytest.raises(ValueError, match=r"y: expected at most 262144 elements"):
        lamport_all_reduce(torch.zeros(64 * 4096 + 1, dtype=torch.bfloat16, device=dev), buf)
    with pytest.raises(TypeError, match="y: expected dtype torch.bfloat16"):
        lamport_all_reduce(torch.zeros(8, device=dev), buf)


@pytest.mark.gpu
def test_lamport_all_reduce_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(tmp_path, _check_lamport, backend="nccl")


@pytest.mark.gpu
def test_symmetric_memory_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    missing = symm_mem_missing("one_shot") + symm_mem_missing("two_shot")
    if missing:
        pytest.skip(f"this torch lacks torch.ops.symm_mem.{missing}")
    spawn(tmp_path, _check_symm, backend="nccl")


def test_decode_plan():
    """kbit generate's plan under torchrun: the config's tensor-parallel entries in styles kbit shards (Qwen3's
    replicated q/k norms left whole), the lm_head by vocabulary where it splits into 16-row units, else whole."""
    transformers = pytest.importorskip("transformers")
    from kbit.hf.tp import decode_plan

    config = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = transformers.Qwen3ForCausalLM(config)
    plan = decode_plan(model, 2)
    assert plan["lm_head"] == "colwise_rep" and plan["layers.*.self_attn.o_proj"] == "rowwise"
    assert not any("norm" in p for p in plan)
    assert "lm_head" not in decode_plan(model, 8)  # 64 rows: not 16 for each of 8 ranks
    with pytest.raises(ValueError, match="model: expected a transformers model whose config has a tensor-parallel"):
        decode_plan(nn.Sequential(nn.Linear(4, 4)), 2)
