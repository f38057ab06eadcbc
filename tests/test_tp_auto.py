"""transformers' ``tp_plan="auto"`` with ``quantization_config=KbitConfig(...)`` (kbit.hf.tp): on 2 gloo ranks (NCCL
variant marked gpu) a tiny random Llama of odd sizes quantized while loading, and a saved kbit folder loaded with
``tp_plan="auto"``: the logits and greedy tokens of one process, each rank holding only its shards (bit-exact
slices, bytes counted), clear errors where the plan cannot be honoured."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from transformers.distributed import DistributedConfig  # noqa: E402
from transformers.quantizers.base import HfQuantizer  # noqa: E402

from kbit.hf import KbitConfig, save_quantized  # noqa: E402
from kbit.hf.tp import TensorParallelKbitExperts, check_heads, take_kbit_entries  # noqa: E402
from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops.dequant import dequantize  # noqa: E402
from kbit.parallel import ColumnParallelKbitLinear, RowParallelKbitLinear  # noqa: E402
from ranks import device, spawn  # noqa: E402

# K = 200 and N = 330 are not multiples of the blocksize or of 2 * 16 rows: padded K, a short last shard
CONFIG = dict(vocab_size=300, hidden_size=200, intermediate_size=330, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)
QC = dict(k=4, blocksize=32)
PROMPT = [[1, 5, 7, 9, 11, 200, 17]]
PARALLEL = (ColumnParallelKbitLinear, RowParallelKbitLinear)


def float_folder(path, **over):
    config = transformers.LlamaConfig(**(CONFIG | over))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


def load(path, backend: str, tp, **kw):
    """``from_pretrained`` with ``tp_plan="auto"`` (``tp`` True; a dict: that plan) or on this rank's device
    alone."""
    if tp:
        kw["tp_plan"] = "auto" if tp is True else tp
    else:
        kw["device_map"] = str(device(backend))
    with warnings.catch_warnings():  # transformers 5.24 prefers distributed_config=DistributedConfig(tp_plan=...)
        warnings.simplefilter("ignore", FutureWarning)
        return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def _as_torchrun(rank, world):
    # transformers binds the device from LOCAL_RANK, as torchrun sets it
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))


def _kbit_bytes(model) -> int:
    """Bytes of the packed codes and block scales of every k-bit layer and expert stack."""
    return sum(t.numel() * t.element_size() for n, t in model.named_buffers() if n.endswith((".codes", ".scales")))


def _check_shards(model, whole, whole_bytes, rank, world) -> None:
    """Every k-bit layer is a parallel one; its shard dequantizes to its slice of the whole weight; the ranks'
    bytes add up to the whole model's (``whole_bytes``, counted before its first forward: on a GPU that repacks the
    layers into the kernels' padded layout) and no rank holds more than its part."""
    names = {n for n, m in model.named_modules() if isinstance(m, PARALLEL)}
    assert len(names) == 14, sorted(names)
    for name, m in model.named_modules():
        if isinstance(m, KbitLinear):
            assert name.rpartition(".")[0] in names, f"{name} is not a shard"
    dev = next(model.parameters()).device
    for name in names:
        m, w = model.get_submodule(name), dequantize(whole.get_submodule(name).weight(), torch.float32)
        part = torch.cat([w[a:b] for a, b in m.ranges]) if isinstance(m, ColumnParallelKbitLinear) else \
            w[:, m.start:m.stop]
        assert torch.equal(dequantize(m.shard.weight(), torch.float32), part.to(dev)), name
    local = torch.tensor([_kbit_bytes(model)], dtype=torch.float64, device=dev)
    total = local.clone()
    dist.all_reduce(total)
    assert total.item() == whole_bytes, (total.item(), whole_bytes)
    assert local.item() < 0.6 * whole_bytes, f"rank {rank} holds {local.item()} of {whole_bytes} bytes"


def _static_tokens(model, ids, steps: int = 5):
    from kbit.hf.decode import StaticDecoder

    dec = StaticDecoder(model, 1, ids.shape[1] + steps + 1, fast=True)
    assert all(f is not None for f in dec._fast.qkv)  # q/k/v: one GEMV a layer, whole or this rank's shards
    toks = [dec.prefill(ids).clone()] + [dec.step().clone() for _ in range(steps - 1)]
    return torch.stack(toks)


def _check_tp(rank, world, backend, float_path, saved_path, dtype, rtol):
    """Quantized while loading, and from a kbit folder: each against the same load on this rank's device alone."""
    _as_torchrun(rank, world)
    ids = torch.tensor(PROMPT, device=device(backend))
    greedy = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    for path, kw in ((float_path, dict(quantization_config=KbitConfig(**QC))), (saved_path, {})):
        whole = load(path, backend, False, dtype=dtype, **kw)
        whole_bytes = _kbit_bytes(whole)
        with torch.no_grad():
            want = whole(ids).logits.double()
        want_tokens = whole.generate(ids, **greedy)
        model = load(path, backend, True, dtype=dtype, **kw)
        assert model.tp_size == world
        _check_shards(model, whole, whole_bytes, rank, world)
        with torch.no_grad():
            got = model(ids).logits.double()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < rtol, f"rank {rank}, {path}: tensor-parallel logits differ by {err:.2e} of max |logit|"
        tokens = model.generate(ids, **greedy)
        if dtype == torch.float32:  # in bf16 a random tiny model's near-ties may flip (lab/parallel/tp_auto.py
            # checks tokens on full-size layers)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
            # StaticDecoder's fast step on the model transformers and kbit split: its fused shard GEMVs, kbit's
            # all-reduces and transformers' gathered lm_head give the whole model's greedy tokens
            assert torch.equal(_static_tokens(model, ids), _static_tokens(whole, ids))
    with pytest.raises(ValueError, match="model: expected an unsharded kbit model to save_pretrained"):
        model.save_pretrained(os.path.join(saved_path, f"again-{rank}"))


def _folders(tmp_path, dtype=torch.float32):
    """A float folder and the kbit folder of it (quantized here, on the CPU, in ``dtype``)."""
    float_path = float_folder(tmp_path / "float")
    saved = tmp_path / "kbit"
    save_quantized(load(float_path, "gloo", False, quantization_config=KbitConfig(**QC), dtype=dtype), saved)
    return float_path, str(saved)


def test_tp_auto_two_ranks(tmp_path):
    spawn(tmp_path, _check_tp, "gloo", *_folders(tmp_path), torch.float32, 1e-4)


@pytest.mark.gpu
def test_tp_auto_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(tmp_path, _check_tp, "nccl", *_folders(tmp_path, torch.bfloat16), torch.bfloat16, 3e-2, backend="nccl")


def _check_moe(rank, world, path, saved):
    """Qwen3-MoE: attention colwise / rowwise, k-bit experts split along I (``moe_tp_experts``), a dense layer;
    quantized while loading, and from a kbit folder."""
    _as_torchrun(rank, world)
    whole = load(path, "gloo", False, quantization_config=KbitConfig(**QC))
    ids = torch.tensor(PROMPT)
    greedy = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    with torch.no_grad():
        want = whole(ids).logits.double()
    want_tokens = whole.generate(ids, **greedy)
    for folder, kw in ((path, dict(quantization_config=KbitConfig(**QC))), (saved, {})):
        model = load(folder, "gloo", True, **kw)
        experts = model.model.layers[0].mlp.experts
        assert isinstance(experts, TensorParallelKbitExperts)
        assert (experts.start, experts.stop) == ((0, 64), (64, 96))[rank]  # I = 96 in units of 32
        assert isinstance(model.model.layers[1].mlp.down_proj, RowParallelKbitLinear)
        local = torch.tensor([_kbit_bytes(model)], dtype=torch.float64)
        total = local.clone()
        dist.all_reduce(total)
        assert total.item() == _kbit_bytes(whole) and local.item() < 0.7 * _kbit_bytes(whole)
        with torch.no_grad():
            got = model(ids).logits.double()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-4, f"rank {rank}, {folder}: tensor-parallel MoE logits differ by {err:.2e} of max |logit|"
        assert torch.equal(model.generate(ids, **greedy), want_tokens)
    # transformers' expert parallel would hook k-bit experts whose stacks load whole: refused, naming the argument
    try:
        dc = DistributedConfig(tp_size=world, ep_size=world)
    except TypeError:  # transformers < 5.21
        dc = DistributedConfig(tp_size=world, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="ep_size: expected 1 with k-bit experts"):
        transformers.AutoModelForCausalLM.from_pretrained(path, distributed_config=dc,
                                                          quantization_config=KbitConfig(**QC))


def test_tp_auto_moe_two_ranks(tmp_path):
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", **(CONFIG | dict(hidden_size=96, intermediate_size=80, head_dim=32, moe_intermediate_size=96,
                                      num_experts=5, num_experts_per_tok=2, decoder_sparse_step=1,
                                      mlp_only_layers=[1])))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "moe")
    save_quantized(load(tmp_path / "moe", "gloo", False, quantization_config=KbitConfig(**QC)), tmp_path / "kbit")
    spawn(tmp_path, _check_moe, str(tmp_path / "moe"), str(tmp_path / "kbit"))


def _check_phi3(rank, world, path):
    """Phi-3's own plan: packed q/k/v and gate/up column-parallel with gathered outputs, o / down row-parallel on
    a replicated input (its attention slices q, k, v by the whole model's sizes)."""
    _as_torchrun(rank, world)
    whole = load(path, "gloo", False, quantization_config=KbitConfig(**QC))
    model = load(path, "gloo", True, quantization_config=KbitConfig(**QC))
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.gather_output and not layer.mlp.down_proj.input_is_parallel
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        want, got = whole(ids).logits.double(), model(ids).logits.double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-4, f"rank {rank}: tensor-parallel Phi-3 logits differ by {err:.2e} of max |logit|"


def test_tp_auto_phi3_two_ranks(tmp_path):
    config = transformers.AutoConfig.for_model("phi3", **(CONFIG | dict(hidden_size=192, head_dim=48)))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path / "phi3")
    spawn(tmp_path, _check_phi3, str(tmp_path / "phi3"))


def _check_plans(rank, world, float_path, mqa_path):
    _as_torchrun(rank, world)
    with pytest.raises(ValueError, match=r"tp_plan: expected num_key_value_heads divisible by the tensor-parallel "
                                         r"size 2 .*, got num_key_value_heads=1"):
        load(mqa_path, "gloo", True, quantization_config=KbitConfig(**QC))
    # one plan entry over quantized and float layers: neither kbit nor transformers can shard all of it
    with pytest.raises(ValueError, match=r"tp_plan\['model.layers.\*.mlp.up_proj'\]: expected an entry over "
                                         r"k-bit modules only"):
        load(float_path, "gloo", True, quantization_config=KbitConfig(**QC, modules_to_not_convert=[
            r"layers\.0\.mlp\.up_proj"]))
    # a quantized lm_head takes the plan's "colwise_gather_output": a k-bit column-parallel head, output gathered
    qc = dict(QC, quantize_lm_head=True)
    whole, model = (load(float_path, "gloo", tp, quantization_config=KbitConfig(**qc)) for tp in (False, True))
    assert isinstance(model.lm_head, ColumnParallelKbitLinear) and model.lm_head.gather_output
    assert model.lm_head.sizes == [160, 140]  # 300 rows in units of 16
    with torch.no_grad():
        want, got = whole(torch.tensor(PROMPT)).logits, model(torch.tensor(PROMPT)).logits
    assert got.shape == want.shape and ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    # a row-parallel split of K would cut a Hadamard rotation (it spans all of K): refused before any weight is read
    with pytest.raises(ValueError, match=r"tp_plan\['model.layers.\*.self_attn.o_proj'\]: expected unrotated"):
        load(float_path, "gloo", True, quantization_config=KbitConfig(**QC, rotation="hadamard"))
    # a tp_plan dict is merged into the model's plan (transformers >= 5.24): kbit takes its k-bit entries too
    plan = {"model.layers.*.self_attn.o_proj": "rowwise"}
    if not hasattr(HfQuantizer, "update_attn_implementation"):  # 5.17 replaces the plan by the dict, unseen
        with pytest.raises(ValueError, match=r"tp_plan: expected 'auto' with kbit on this transformers version"):
            load(float_path, "gloo", plan, quantization_config=KbitConfig(**QC))
        return
    model = load(float_path, "gloo", plan, quantization_config=KbitConfig(**QC))
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.o_proj, RowParallelKbitLinear) and isinstance(attn.q_proj, ColumnParallelKbitLinear)
    assert type(model.lm_head.weight).__name__ == "DTensor"  # the float entries still go to transformers
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor(PROMPT)).logits).all()


def test_tp_auto_errors_and_plan_dict_two_ranks(tmp_path):
    spawn(tmp_path, _check_plans, float_folder(tmp_path / "float"),
          float_folder(tmp_path / "mqa", num_key_value_heads=1))


def test_plan_split_and_head_checks():
    config = transformers.LlamaConfig(**CONFIG)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    plan = dict(model.tp_plan)
    kinds = {n: "linear" for n, m in model.named_modules() if n.endswith(("_proj",))}
    taken = take_kbit_entries(model, plan, kinds)
    assert set(taken) == {f"model.layers.*.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                          "mlp.down_proj")}
    # transformers keeps the float modules' entries (embed_tokens: 5.24 adds "embedding_rowwise", 5.17 none)
    assert plan["lm_head"] == "colwise_gather_output" and set(plan) <= {"lm_head", "model.embed_tokens"}
    check_heads(config, taken, 2, 64)
    with pytest.raises(ValueError, match=r"tp_plan: expected head_dim a multiple of the split unit 128 .*, got "
                                         r"head_dim=64"):
        check_heads(config, taken, 2, 128)
    with pytest.raises(ValueError, match=r"tp_plan\['model.layers.\*.mlp.up_proj'\]: expected a style kbit shards"):
        take_kbit_entries(model, {"model.layers.*.mlp.up_proj": "sequence_parallel"}, kinds)
