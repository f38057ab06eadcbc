"""kbit.parallel sharded checkpoints: ``save_sharded`` from a whole model (column / row / expert shards, replicated
tensors), ``load_sharded`` on 2 processes (gloo) into a ``meta`` skeleton reading only the rank's own file, outputs
equal to the unsharded model's; a file of another world size, a damaged, truncated or foreign file refused."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

import kbit
import kbit.parallel.checkpoint as ckpt
from kbit.nn import KbitLinear, KbitMoE
from kbit.parallel import (
    ColumnParallelKbitLinear,
    ExpertParallelKbitMoE,
    RowParallelKbitLinear,
    ShardReader,
    ShardWriter,
    load_sharded,
    read_index,
    save_sharded,
    shard_layout,
    shard_specs,
    write_index,
)
from kbit.parallel.checkpoint import rank_file, shard_tensors
from ranks import spawn

PLAN = {"layers.*.attn.qkv": "packed_colwise", "layers.*.attn.o": "rowwise", "layers.*.mlp": "ep",
        "lm_head": "colwise_rep"}
H, E, I, TOP_K, VOCAB = 96, 7, 40, 3, 50


class _Block(nn.Module):
    def __init__(self, layer, device):
        super().__init__()
        kw = dict(k=4, blocksize=32, dtype=torch.float32, device=device)
        self.attn = nn.Module()
        self.attn.qkv = KbitLinear(H, 3 * 64, bias=False, **kw)
        self.attn.qkv.packed_parts = (64, 64, 64)
        self.attn.o = KbitLinear(64, H, bias=True, **kw)
        self.norm = nn.Parameter(torch.ones(H, device=device))
        shared = nn.Linear(H, H, bias=False, device=device) if layer == 0 else None
        self.mlp = KbitMoE(E, H, I, TOP_K, has_router_weight=True, shared_expert=shared, k=3, blocksize=32,
                           dtype=torch.float32, device=device)

    def forward(self, x):
        qkv = self.attn.qkv
        q, k, v = qkv(x).split(list(getattr(qkv, "local_parts", None) or qkv.packed_parts), dim=-1)
        x = x + self.attn.o(torch.sigmoid(q) * k + v)  # column-local, as per-head attention
        return x + self.mlp(x * self.norm)


class _Model(nn.Module):
    def __init__(self, device=None, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H, device=device)
        self.layers = nn.ModuleList(_Block(i, device) for i in range(layers))
        self.out = KbitLinear(H, H, bias=False, k=5, dtype=torch.float32, device=device)  # not planned: replicated
        self.lm_head = KbitLinear(H, VOCAB, bias=False, k=4, dtype=torch.float32, device=device)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.out(x))


def _whole(seed=0) -> _Model:
    torch.manual_seed(seed)
    model = _Model()
    for m in list(model.modules()):
        if isinstance(m, KbitLinear):
            qw = kbit.quantize(torch.randn(m.out_features, m.in_features) / m.in_features**0.5, k=m.k)
            m.codes, m.scales, m.tensor_scale, m.codebook = qw.codes, qw.scales, qw.tensor_scale, qw.codebook
            if m.bias is not None:
                m.bias.normal_()
        elif isinstance(m, KbitMoE):
            new = KbitMoE.from_float(torch.randn(E, 2 * I, H) / H**0.5, torch.randn(E, H, I) / I**0.5, TOP_K, k=3,
                                     dtype=torch.float32, router_weight=torch.randn(E, H))
            for name, t in new._buffers.items():
                setattr(m, name, t)
    return model






def _check_load(rank, world, directory, ids, want):
    opened = []
    real = ShardReader.__init__

    def spy(self, path):
        opened.append(os.path.basename(path))
        real(self, path)

    ShardReader.__init__ = spy
    try:
        model = load_sharded(directory, model=_Model(device="meta"), device="cpu")
    finally:
        ShardReader.__init__ = real
    assert opened == [f"rank-{rank}-of-2.kbit.safetensors"]
    moe = model.layers[0].mlp
    assert isinstance(moe, ExpertParallelKbitMoE) and moe.local.num_experts == (4, 3)[rank]
    assert isinstance(moe.shared_expert, nn.Linear) and moe.shared_expert.weight.device.type == "cpu"
    assert isinstance(model.layers[1].attn.qkv, ColumnParallelKbitLinear)
    assert model.layers[1].attn.qkv.local_parts == [32, 32, 32]
    assert isinstance(model.layers[1].attn.o, RowParallelKbitLinear) and model.layers[1].attn.o.bias is not None
    assert not any(t.is_meta for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    with torch.no_grad():
        got = model(ids).double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"rank {rank}: the loaded shards differ from the whole model by {err:.2e}"


def test_save_and_load_two_ranks(tmp_path):
    model = _whole()
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).double()
    index = save_sharded(model, tmp_path / "ckpt", PLAN, world=2)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["kbit-sharded.json", "rank-0-of-2.kbit.safetensors",
                                                     "rank-1-of-2.kbit.safetensors"]
    assert index["modules"]["layers.0.mlp"]["ranges"] == [[0, 4], [4, 7]]
    assert index["modules"]["layers.1.attn.o"]["ranges"] == [[[0, 32]], [[32, 64]]]
    assert "embed.weight" in index["replicated"] and "out.codes" in index["replicated"]
    assert "layers.0.mlp.shared_expert.weight" in index["replicated"]
    # a rank file is an ordinary kbit file: its shards are KbitWeights
    part = kbit.load_file(tmp_path / "ckpt" / "rank-1-of-2.kbit.safetensors")
    assert part["layers.0.mlp.gate_up"].shape == (3, 2 * I, H) and part["layers.0.attn.o.weight"].shape == (H, 32)
    assert torch.equal(part["embed.weight"], model.embed.weight.detach())
    spawn(tmp_path, _check_load, str(tmp_path / "ckpt"), ids, want)


def _check_refused(rank, world, other, damaged):
    with pytest.raises(ValueError, match="directory: expected a checkpoint for 2 ranks .* got one for 1 ranks"):
        load_sharded(other, model=_Model(device="meta"))
    with pytest.raises(ValueError, match=f"rank: expected this process's rank in the group \\({rank}\\)"):
        load_sharded(damaged, 1 - rank, model=_Model(device="meta"))
    if rank == 1:  # rank 1's file has a flipped byte
        with pytest.raises(ValueError, match="checksum mismatch.*the data is damaged"):
            load_sharded(damaged, model=_Model(device="meta"), device="cpu")
    else:
        load_sharded(damaged, model=_Model(device="meta"), device="cpu")


def test_other_world_and_damaged_file_two_ranks(tmp_path):
    model = _whole(seed=3)
    save_sharded(model, tmp_path / "one", PLAN, world=1)
    save_sharded(model, tmp_path / "two", PLAN, world=2)
    path = tmp_path / "two" / "rank-1-of-2.kbit.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10  # in the tensor data (the last tensors are uint8 scales)
    path.write_bytes(bytes(data))
    spawn(tmp_path, _check_refused, str(tmp_path / "one"), str(tmp_path / "two"))


def test_damage_detected_without_ranks(tmp_path):
    model = _whole(seed=4)
    save_sharded(model, tmp_path / "a", PLAN, world=2)
    save_sharded(_whole(seed=5), tmp_path / "b", PLAN, world=2)
    index = read_index(tmp_path / "a")
    rank0 = tmp_path / "a" / "rank-0-of-2.kbit.safetensors"
    reader = ckpt._open_rank_file(tmp_path / "a", index, 0)
    assert reader.get("embed.weight").shape == (VOCAB, H)
    # a file of another checkpoint with the same layout: its metadata checksum differs from the index's record
    os.replace(tmp_path / "b" / "rank-0-of-2.kbit.safetensors", rank0)
    with pytest.raises(ValueError, match="belongs to another checkpoint"):
        ckpt._open_rank_file(tmp_path / "a", index, 0)
    # truncated
    data = rank0.read_bytes()
    rank0.write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated"):
        ckpt._open_rank_file(tmp_path / "a", index, 0)
    with pytest.raises(ValueError, match="truncated or extended"):
        ShardReader(rank0)
    # an edited header entry (the metadata checksum no longer matches)
    n = int.from_bytes(data[:8], "little")
    head = data[8:8 + n].replace(b'"kbit.shard":"{\\"rank\\": 0', b'"kbit.shard":"{\\"rank\\": 1')
    assert head != data[8:8 + n]
    rank0.write_bytes(data[:8] + head + data[8 + n:])
    with pytest.raises(ValueError, match="metadata checksum mismatch"):
        ShardReader(rank0)
    # the index itself
    path = tmp_path / "a" / "kbit-sharded.json"
    doc = json.loads(path.read_text())
    doc["world"] = 4
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="index checksum mismatch"):
        read_index(tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="directory: expected a sharded kbit checkpoint"):
        read_index(tmp_path)


def test_layout_of_a_meta_skeleton():
    """The layout (and so a rank's file) follows from shapes alone: a meta skeleton gives the whole model's."""
    whole, meta = shard_layout(_whole(), PLAN, 2), shard_layout(_Model(device="meta"), PLAN, 2)
    assert whole == meta
    assert meta["modules"]["lm_head"]["ranges"] == [[[0, 32]], [[32, 50]]]
    assert meta["modules"]["layers.0.attn.qkv"]["ranges"][1] == [[32, 64], [96, 128], [160, 192]]
    with pytest.raises(ValueError, match="plan: expected patterns matching"):
        shard_layout(_Model(device="meta"), {"nothing": "colwise"}, 2)
    with pytest.raises(ValueError, match="module 'layers.0.attn.qkv' .* world 3.*: size: expected at least 3 units"):
        shard_layout(_Model(device="meta"), PLAN, 3)


def _check_inconsistent(rank, world, directory):
    with pytest.raises(ValueError, match=r"directory: expected the same replicated .* first \['embed.weight'\]"):
        load_sharded(directory, model=_Model(device="meta"), device="cpu")


def test_replicated_tensors_must_agree_two_ranks(tmp_path):
    """Rank files written each from its own source (as big_model.py does) must hold the same replicated tensors."""
    model = _whole(seed=6)
    index = save_sharded(model, tmp_path / "c", PLAN, world=2)
    layout = {k: v for k, v in index.items() if k != "files"}
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.embed.weight.add_(1.0)
    specs, weights = shard_specs(layout, 1)
    writer = ShardWriter(tmp_path / "c" / rank_file(1, 2), specs, weights)
    for name, d in layout["modules"].items():
        for key, t in shard_tensors(other.get_submodule(name), d, name, 1).items():
            writer.write(key, t)
    state = other.state_dict()
    for key in layout["replicated"]:
        writer.write(key, state[key])
    write_index(tmp_path / "c", layout, [index["files"][0], writer.close()])
    spawn(tmp_path, _check_inconsistent, str(tmp_path / "c"))


def _check_hf_load(rank, world, shards, folder, ids, want):
    """A rank builds the transformers model from the folder's config alone (kbit.hf.empty_quantized: nothing
    read) and fills it from its own shard file."""
    from kbit.hf import empty_quantized

    model = load_sharded(shards, model=empty_quantized(folder), device="cpu")
    assert isinstance(model.model.layers[0].self_attn.q_proj, ColumnParallelKbitLinear)
    assert not any(t.is_meta for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    with torch.no_grad():
        got = model(ids).logits.double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"rank {rank}: the loaded shards differ from the whole model by {err:.2e}"


def test_hf_model_from_a_sharded_checkpoint(tmp_path):
    """quantize_model -> save_quantized -> save_sharded; on 2 ranks each loads only its file into the skeleton of
    the saved folder, and the logits equal the whole model's."""
    transformers = pytest.importorskip("transformers")
    from kbit.parallel import LLAMA_PLAN

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    model = kbit.quantize_model(transformers.LlamaForCausalLM(cfg).eval(), k=4)
    kbit.save_quantized(model, tmp_path / "folder")
    save_sharded(model, tmp_path / "shards", LLAMA_PLAN, world=2)
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits.double()
    spawn(tmp_path, _check_hf_load, str(tmp_path / "shards"), str(tmp_path / "folder"), ids, want)


def test_empty_quantized_refuses_a_plain_folder(tmp_path):
    pytest.importorskip("transformers")
    from kbit.hf import empty_quantized

    with pytest.raises(ValueError, match="directory"):
        empty_quantized(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="quant_method"):
        empty_quantized(tmp_path)
