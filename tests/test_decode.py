"""kbit.hf.decode.StaticDecoder: the static-cache decode step against transformers' dynamic cache (CPU, eager),
and the CUDA-graph step against the eager one (GPU); benchmarks/bench_e2e.py on tiny configs (CPU)."""

import importlib.util
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kbit.hf import quantize_model  # noqa: E402
from kbit.hf.decode import StaticDecoder, use_kbit_moe  # noqa: E402
from kbit.hf.experts import KbitExperts  # noqa: E402
from kbit.nn import KbitMoE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [[1, 5, 9, 33, 2], [7, 3, 3, 60, 11]]


def llama(vocab=96, tie=False):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=64, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def qwen3_moe():
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=96,
                                         max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def dynamic_greedy(model, ids: torch.Tensor, n: int):
    """Reference: transformers' dynamic cache, argmax, batch rows together; tokens [B, n], logits [n, B, V]."""
    toks, logits = [], []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for _ in range(n):
            lg = out.logits[:, -1].float()
            t = lg.argmax(-1)
            toks.append(t)
            logits.append(lg)
            out = model(t.view(-1, 1), past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(toks, 1), torch.stack(logits)


def static_greedy(model, ids: torch.Tensor, n: int, graph=False, **kw):
    dec = StaticDecoder(model, ids.shape[0], ids.shape[1] + n, graph=graph, **kw)
    toks, logits = [dec.prefill(ids).clone()], [dec.logits.clone()]
    for _ in range(n - 1):
        toks.append(dec.step().clone())
        logits.append(dec.logits.clone())
    return torch.stack(toks, 1), torch.stack(logits)


@pytest.fixture(scope="module")
def kbit_llama():
    return quantize_model(llama(), k=4, progress=False)


@pytest.mark.parametrize("quantized", [False, True])
def test_static_matches_dynamic_llama(quantized, kbit_llama):
    model = kbit_llama if quantized else llama()
    ids = torch.tensor(PROMPT)
    ref_t, ref_l = dynamic_greedy(model, ids, 6)
    t, lg = static_greedy(model, ids, 6)
    assert torch.equal(t, ref_t)
    torch.testing.assert_close(lg, ref_l, atol=1e-4, rtol=1e-4)


def test_static_matches_dynamic_qwen3_moe():
    model = quantize_model(qwen3_moe(), k=4, progress=False)  # KbitExperts (the looping HF adapter)
    ids = torch.tensor(PROMPT[:1])
    ref_t, ref_l = dynamic_greedy(model, ids, 3)
    t, lg = static_greedy(model, ids, 3)
    assert torch.equal(t, ref_t)
    torch.testing.assert_close(lg, ref_l, atol=1e-4, rtol=1e-4)
    # the same k-bit tensors in KbitMoE (device-side routing): same tokens
    assert use_kbit_moe(model) == 2
    assert not any(isinstance(m, KbitExperts) for m in model.modules())
    t2, lg2 = static_greedy(model, ids, 3)
    assert torch.equal(t2, ref_t)
    torch.testing.assert_close(lg2, ref_l, atol=1e-3, rtol=1e-3)


def test_sampling_reproducible_and_rewind(kbit_llama):
    ids = torch.tensor(PROMPT)
    a, _ = static_greedy(kbit_llama, ids, 5, temperature=1.0, top_k=20, seed=3)
    b, _ = static_greedy(kbit_llama, ids, 5, temperature=1.0, top_k=20, seed=3)
    assert torch.equal(a, b)
    dec = StaticDecoder(kbit_llama, 2, 12)
    first = dec.prefill(ids).clone()
    x = [dec.step().clone() for _ in range(3)]
    dec.rewind(5)
    dec.ids.copy_(first.view(-1, 1))
    y = [dec.step().clone() for _ in range(3)]
    assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))


def test_bad_input(kbit_llama):
    with pytest.raises(ValueError, match="batch_size"):
        StaticDecoder(kbit_llama, 0, 8)
    with pytest.raises(ValueError, match="max_len"):
        StaticDecoder(kbit_llama, 1, 1)
    with pytest.raises(ValueError, match="graph"):
        StaticDecoder(kbit_llama, 1, 8, graph=True)
    with pytest.raises(ValueError, match=r"top_k: expected >= 0 \(0: off\), got -1"):
        StaticDecoder(kbit_llama, 1, 8, top_k=-1)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"top_p: expected in \(0, 1\]"):
            StaticDecoder(kbit_llama, 1, 8, top_p=top_p)
    dec = StaticDecoder(kbit_llama, 2, 8)
    with pytest.raises(ValueError, match=r"input_ids: expected shape \[2, T\]"):
        dec.prefill(torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len = 16"):  # rounded up to a multiple of 16
        dec.prefill(torch.ones(2, 16, dtype=torch.long))
    with pytest.raises(RuntimeError, match="prefill first"):
        dec.step()
    with pytest.raises(ValueError, match="k: expected the bits"):
        use_kbit_moe(qwen3_moe())


def test_use_kbit_moe_quantizes_float_blocks():
    model = qwen3_moe()
    assert use_kbit_moe(model, k=4) == 2
    assert sum(isinstance(m, KbitMoE) for m in model.modules()) == 2


def tiny_lm(model_type: str, **kw):
    """A tiny random causal LM of ``model_type`` (two layers, hidden 64; ``kw`` over those sizes); skips where
    transformers lacks the family."""
    small = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96, num_experts_per_tok=2,
                 max_position_embeddings=64)
    try:
        config = transformers.AutoConfig.for_model(model_type, **(small | kw))
    except (KeyError, ValueError):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _moe_model(model_type: str, **kw):
    """:func:`tiny_lm` quantized at k = 4, with nonzero router correction biases (zeros at init would hide a router
    that ignores them)."""
    model = quantize_model(tiny_lm(model_type, **kw), k=4, progress=False)
    for m in model.modules():
        bias = getattr(getattr(m, "gate", None), "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            bias.data = torch.randn(bias.shape, generator=torch.Generator().manual_seed(1)) * 0.1
    return model


@pytest.mark.parametrize("model_type, kw, blocks", [
    ("qwen2_moe", dict(num_experts=4, shared_expert_intermediate_size=64), 2),  # shared expert + its gate
    ("deepseek_v3", dict(n_routed_experts=8, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                         first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16, head_dim=8), 1),  # sigmoid, groups, scaling, shared
    ("glm4_moe", dict(n_routed_experts=4, first_k_dense_replace=1, routed_scaling_factor=1.5, head_dim=16), 1),
])
def test_use_kbit_moe_reproduces_the_block(model_type, kw, blocks):
    """KbitMoE takes over blocks with shared experts and DeepSeek-V3-style routers: the same logits as the
    transformers blocks over the same k-bit experts."""
    model = _moe_model(model_type, **kw)
    x = torch.tensor(PROMPT[:1])
    with torch.no_grad():
        want = model(x).logits
    assert use_kbit_moe(model) == blocks
    assert not any(isinstance(m, KbitExperts) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, want, rtol=1e-4, atol=1e-4)


def test_use_kbit_moe_keeps_a_block_it_does_not_reproduce(monkeypatch):
    """A router KbitMoE would get wrong (here: DeepSeek-V3's read as softmax) is caught before the swap: the
    block stays, with a warning naming it."""
    from kbit.hf import decode
    from kbit.nn import moe

    real = moe.hf_routing

    def as_softmax(block):
        out = real(block)
        for key in ("correction_bias", "n_group", "topk_group", "routed_scaling_factor"):
            out.pop(key, None)
        return out | {"router": "softmax"}

    model = _moe_model("deepseek_v3", n_routed_experts=8, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                       first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=16, head_dim=8)
    monkeypatch.setattr(decode, "hf_routing", as_softmax)
    with pytest.warns(UserWarning, match=r"kept as transformers runs it.*layers\.1\.mlp \(DeepseekV3MoE: the gate"):
        assert use_kbit_moe(model) == 0
    assert isinstance(model.model.layers[1].mlp.experts, KbitExperts)
    model = _moe_model("qwen2_moe", num_experts=4, shared_expert_intermediate_size=64)
    for m in model.modules():  # a shared expert KbitMoE would not add: the outputs differ
        if hasattr(m, "shared_expert"):
            m.shared_expert_gate.weight.data.fill_(0.0)
    monkeypatch.setattr(decode, "hf_routing", lambda block: real(block) | {"shared_expert": None})
    with pytest.warns(UserWarning, match=r"its output differs by"):
        assert use_kbit_moe(model) == 0


def _bench():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "benchmarks" / "bench_e2e.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("extra", [[], ["--fuse-proj"]])
def test_bench_e2e_tiny(tmp_path, extra):
    bench = _bench()
    rows = bench.run(bench.parse(["--tiny", "--device", "cpu", "--models", "llama-tiny", "--k", "4", "--batch",
                                  "1,2", "--ctx", "6", "--steps", "2", "--reps", "1", "--out", str(tmp_path), *extra]))
    assert [(r["variant"], r["batch"]) for r in rows] == [("bf16", 1), ("bf16", 2), ("kbit", 1), ("kbit", 2)]
    assert all(r["logits_finite"] and r["tokens_per_s"] > 0 for r in rows)
    assert "llama-tiny" in (tmp_path / "e2e.md").read_text() and (tmp_path / "e2e.json").exists()


def test_bench_e2e_tiny_moe(tmp_path):
    """Both MoE shapes of the benchmark, bf16 (transformers' blocks and kbit's routing on torch's grouped
    product) and kbit (KbitMoE)."""
    bench = _bench()
    rows = bench.run(bench.parse(["--tiny", "--device", "cpu", "--models", "qwen3moe-tiny,mixtral-tiny", "--k", "4",
                                  "--batch", "2", "--ctx", "6", "--steps", "2", "--reps", "1", "--out",
                                  str(tmp_path)]))
    assert [(r["model"], r["variant"]) for r in rows] == [
        (m, v) for m in ("qwen3moe-tiny", "mixtral-tiny") for v in ("bf16", "bf16-kr", "kbit")]
    assert all(r["logits_finite"] and r["tokens_per_s"] > 0 for r in rows), [r.get("error") for r in rows]


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "qwen3moe-tiny", "mixtral-tiny"])
def test_bench_fused_projections_same_model(name):
    bench = _bench()
    config = bench.configs(tiny=True)[name]
    ids = torch.tensor(PROMPT)
    ref = static_greedy(bench.build_bf16(config, "cpu").float(), ids, 4)
    fused = bench.build_bf16(config, "cpu", fuse_proj=True).float()
    assert hasattr(fused.model.layers[0].self_attn, "qkv_proj")
    got = static_greedy(fused, ids, 4)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
    owners = [m.__dict__["_kbit_fused_owner"] for m in fused.modules() if "_kbit_fused_owner" in m.__dict__]
    assert owners and all("y" not in o for o in owners)  # no product kept between calls
    att = bench.build_kbit(config, "cpu", 4, fuse_proj=True).model.layers[0].self_attn  # joint q/k/v
    assert torch.equal(att.q_proj.tensor_scale, att.k_proj.tensor_scale)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gpu_graph_equals_eager(arch, temperature):
    model = llama(vocab=256) if arch == "llama" else qwen3_moe()
    model = model.to(device="cuda", dtype=torch.bfloat16)
    if arch == "llama":
        quantize_model(model, k=4, progress=False)
    else:
        use_kbit_moe(model, k=4)
        quantize_model(model, k=4, include=[r"self_attn\.(q|k|v|o)_proj"], progress=False)
    ids = torch.tensor(PROMPT, device="cuda")
    kw = {"temperature": temperature, "top_k": 20, "seed": 5}
    eager_t, eager_l = static_greedy(model, ids, 8, graph=False, **kw)
    graph_t, graph_l = static_greedy(model, ids, 8, graph=True, **kw)
    assert torch.equal(graph_t, eager_t)
    torch.testing.assert_close(graph_l, eager_l, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_static_matches_dynamic_bf16():
    model = llama(vocab=256).to(device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor(PROMPT, device="cuda")
    ref_t, _ = dynamic_greedy(model, ids, 6)
    t, _ = static_greedy(model, ids, 6, graph=True)
    assert (t == ref_t).float().mean() >= 0.9  # bf16: attention over a masked static cache may round differently


@pytest.mark.gpu
def test_gpu_a_step_that_waits_on_the_host_runs_without_a_graph(monkeypatch):
    """PhiMoE's rotary embedding branches on a device tensor every call. The decoder finds such a sync in its last
    warm-up step: a default graph is turned off with a warning naming the line (the tokens are the eager steps'),
    a graph asked for raises. A step without one is captured, without a warning."""
    model = llama(vocab=256).to(device="cuda", dtype=torch.bfloat16)
    quantize_model(model, k=4, progress=False)
    ids = torch.tensor(PROMPT, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dec = StaticDecoder(model, 2, 16, fast=False)
        dec.prefill(ids)
        dec.step()
        assert dec.graph and dec._cuda_graph is not None
    rotary = model.model.rotary_emb
    original = rotary.forward

    def syncing(x, position_ids):
        if position_ids.max() >= 0:  # a branch on a device value: the host waits
            return original(x, position_ids)
        raise AssertionError

    monkeypatch.setattr(rotary, "forward", syncing)
    want, _ = static_greedy(model, ids, 6, graph=False, fast=False)
    with pytest.warns(UserWarning, match=r"without a CUDA graph: .*waits on the host \(test_decode\.py:\d+"):
        got, _ = static_greedy(model, ids, 6, graph=None, fast=False)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"graph: the decode step waits on the host"):
        static_greedy(model, ids, 6, graph=True, fast=False)


def test_compile_glue_same_tokens():
    from kbit.hf.decode import compile_glue, uncompile_glue

    model = llama()
    ids = torch.tensor(PROMPT[:1])
    ref_t, ref_l = static_greedy(model, ids, 3)
    patched = compile_glue(model)
    try:
        assert sum(".mlp" in n for n in patched) == 2 and any("apply_rotary_pos_emb" in n for n in patched)
        t, lg = static_greedy(model, ids, 3)
    finally:
        uncompile_glue(model)
    assert torch.equal(t, ref_t)
    torch.testing.assert_close(lg, ref_l, atol=1e-4, rtol=1e-4)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.gpu
def test_gpu_compile_glue_graph_equals_eager():
    from kbit.hf.decode import compile_glue, uncompile_glue

    model = quantize_model(llama(vocab=256).to(device="cuda", dtype=torch.bfloat16), k=4, progress=False)
    ids = torch.tensor(PROMPT, device="cuda")
    plain_t, _ = static_greedy(model, ids, 6, graph=True)
    compile_glue(model)
    try:
        eager_t, eager_l = static_greedy(model, ids, 6, graph=False)
        graph_t, graph_l = static_greedy(model, ids, 6, graph=True)
    finally:
        uncompile_glue(model)
    assert torch.equal(graph_t, eager_t)
    torch.testing.assert_close(graph_l, eager_l, atol=1e-2, rtol=1e-2)
    assert (graph_t == plain_t).float().mean() >= 0.8  # fused norms may round differently from the eager ops


def test_decode_steps_write_at_pos(kbit_llama):
    dec = StaticDecoder(kbit_llama, 2, 12)
    dec.prefill(torch.tensor(PROMPT))
    for _ in range(3):
        dec.step()
    assert int(dec.pos) == 8 and dec.length == 8 and dec.L == 16
    # the steps wrote positions 5..7 of every layer (the fast path does not move transformers' counter)
    for layer in dec.cache.layers:
        assert int(layer.cumulative_length) == 5
        assert layer.keys[:, :, 5:8].abs().sum() > 0 and layer.keys[:, :, 8:].abs().sum() == 0


def qwen3():
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96,
                                      max_position_embeddings=64)
    torch.manual_seed(1)
    return transformers.Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("name", ["llama", "kbit_llama", "qwen3", "qwen3_moe"])
def test_fast_step_matches_dynamic(name, kbit_llama):
    """kbit.hf.fast_decode (glue kernels, through the interpreter on the CPU) against transformers' dynamic cache."""
    if name == "qwen3_moe":
        model = quantize_model(qwen3_moe(), k=4, progress=False)
        use_kbit_moe(model)
    else:
        model = {"llama": llama, "qwen3": qwen3, "kbit_llama": lambda: kbit_llama}[name]()
    ids = torch.tensor(PROMPT)
    ref_t, ref_l = dynamic_greedy(model, ids, 5)
    dec = StaticDecoder(model, ids.shape[0], ids.shape[1] + 5, fast=True)
    assert dec._fast is not None
    if name == "kbit_llama":  # joint q/k/v and gate/up: one GEMV each
        assert all(f is not None for f in dec._fast.qkv + dec._fast.gate_up)
    toks, logits = [dec.prefill(ids).clone()], [dec.logits.clone()]
    for _ in range(4):
        toks.append(dec.step().clone())
        logits.append(dec.logits.clone())
    assert torch.equal(torch.stack(toks, 1), ref_t)
    torch.testing.assert_close(torch.stack(logits), ref_l, atol=2e-3 if name == "qwen3_moe" else 1e-4, rtol=1e-3)


def test_quantize_model_joint_groups():
    """q/k/v and gate/up are quantized as one matrix (shared tensor scale), each keeping its rows; o/down alone;
    joint=False or differing overrides quantize each on its own."""
    from kbit.ops.quantize import quantize

    model = llama()
    att, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    w_qkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).detach().clone()
    w_gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().clone()
    w_o = att.o_proj.weight.detach().clone()
    quantize_model(model, k=3, progress=False)
    att, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for parts, w in (([att.q_proj, att.k_proj, att.v_proj], w_qkv), ([mlp.gate_proj, mlp.up_proj], w_gu)):
        qw = quantize(w, k=3)
        assert torch.equal(torch.cat([m.codes for m in parts]), qw.codes)
        assert torch.equal(torch.cat([m.scales for m in parts]), qw.scales)
        assert all(torch.equal(m.tensor_scale, qw.tensor_scale) for m in parts)
    assert torch.equal(att.o_proj.tensor_scale, quantize(w_o, k=3).tensor_scale)

    alone = quantize_model(llama(), k=3, progress=False, joint=False).model.layers[0].self_attn
    assert not torch.equal(alone.q_proj.tensor_scale, alone.k_proj.tensor_scale)
    mixed = quantize_model(llama(), k=3, progress=False, overrides={r"k_proj": {"k": 4}}).model.layers[0]
    assert mixed.self_attn.k_proj.k == 4 and not torch.equal(mixed.self_attn.q_proj.tensor_scale,
                                                             mixed.self_attn.v_proj.tensor_scale)
    assert torch.equal(mixed.mlp.gate_proj.tensor_scale, mixed.mlp.up_proj.tensor_scale)


def test_fuse_group_shares_memory():
    from kbit.hf.fast_decode import fuse_group

    model = quantize_model(llama(), k=4, progress=False)
    att = model.model.layers[1].self_attn
    parts = [att.q_proj, att.k_proj, att.v_proj]
    x = torch.randn(3, 64)
    want = [m(x) for m in parts]
    fused, rows = fuse_group(parts)
    assert rows == [m.out_features for m in parts]
    y = fused(x)
    torch.testing.assert_close(y, torch.cat(want, -1), rtol=1e-5, atol=1e-5)
    for m, w in zip(parts, want, strict=True):  # the members now view the fused buffers and still work
        assert m.codes.untyped_storage().data_ptr() == fused.codes.untyped_storage().data_ptr()
        torch.testing.assert_close(m(x), w, rtol=0, atol=0)
    assert fuse_group([att.q_proj, att.o_proj]) is None  # o_proj: its own tensor scale
    from kbit.hf import load_quantized, save_quantized

    with tempfile.TemporaryDirectory() as d:  # members holding views save and load as before
        save_quantized(model, d)
        back = load_quantized(d).model.layers[1].self_attn
        for name, w in zip(("q_proj", "k_proj", "v_proj"), want, strict=True):
            torch.testing.assert_close(getattr(back, name)(x), w, rtol=0, atol=0)
    alone = quantize_model(llama(), k=4, progress=False, joint=False).model.layers[0].self_attn
    assert fuse_group([alone.q_proj, alone.k_proj, alone.v_proj]) is None


def test_fast_step_unsupported():
    from kbit.hf.fast_decode import unsupported_reason

    model = llama()
    assert unsupported_reason(model, 32) is None
    model.config.model_type = "gpt2"
    assert "model_type" in unsupported_reason(model, 32)
    with pytest.raises(ValueError, match="fast decode step"):
        StaticDecoder(model, 1, 16, fast=True)
    assert StaticDecoder(model, 1, 16)._fast is None  # auto: transformers' forward


@pytest.mark.parametrize("model_type, kw", [
    ("gpt_oss", dict(num_local_experts=4, layer_types=None, sliding_window=4)),  # attention sinks, sliding layers
    ("gemma2", dict(attn_logit_softcapping=20.0, final_logit_softcapping=None, sliding_window=4)),  # soft-capping
    ("gemma3_text", dict(sliding_window=4)),  # five sliding layers to one full: here layer 0 slides, layer 1 not
    ("mistral", dict(sliding_window=4)),  # no layer_types: every layer slides
    ("deepseek_v3", dict(num_key_value_heads=4, head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                         q_lora_rank=32, kv_lora_rank=32, n_routed_experts=4, n_group=1, topk_group=1,
                         first_k_dense_replace=1)),  # latent attention: keys of 24, values of 16
])
def test_static_decoder_own_attention_and_sliding_windows(model_type, kw):
    """An attention call with arguments static_attention does not compute (gpt-oss's sinks, Gemma-2's soft-capping)
    runs the model's own eager attention, and sliding windows shorter than the prompt + steps mask as transformers
    masks them: the static decoder's tokens and logits are transformers' (before, the sinks were dropped silently,
    and a window shorter than the cache failed on mismatched shapes). DeepSeek's values are narrower than its keys
    (the one-token step's output was reshaped to the key width and failed)."""
    model = tiny_lm(model_type, intermediate_size=64, **kw)
    for m in model.modules():  # gpt-oss's sinks start at zero: make them matter
        if isinstance(getattr(m, "sinks", None), torch.Tensor):
            m.sinks.data = torch.randn(m.sinks.shape, generator=torch.Generator().manual_seed(2)) * 2
    model = quantize_model(model, k=4, progress=False)
    ids = torch.tensor(PROMPT)
    assert ids.shape[1] + 6 > 4  # past the window
    ref_t, ref_l = dynamic_greedy(model, ids, 6)
    t, lg = static_greedy(model, ids, 6)
    assert torch.equal(t, ref_t)
    torch.testing.assert_close(lg, ref_l, atol=1e-4, rtol=1e-4)


def test_graph_blocker_names_experts_that_wait_on_the_host():
    """Looping experts (transformers' own under the eager implementation) sync with the host each step: the
    decoder's default takes no CUDA graph there and a graph asked for is refused naming the block; KbitExperts
    (the grouped kernels on CUDA) and KbitMoE are graph-safe."""
    from kbit.hf.decode import graph_blocker

    assert graph_blocker(llama()) is None
    model = qwen3_moe()
    model.config._experts_implementation = "grouped_mm"  # transformers' default where torch has grouped GEMMs
    assert graph_blocker(model) is None
    model.config._experts_implementation = "eager"  # a loop over the routed experts
    assert graph_blocker(model).startswith("model.layers.0.mlp.experts (Qwen3MoeExperts)")
    quantize_model(model, k=4, progress=False)
    assert graph_blocker(model) is None


def test_attention_windows_from_the_config():
    from kbit.hf.decode import attention_windows

    model = llama()
    assert attention_windows(model) is None
    model.config.sliding_window = 8
    assert attention_windows(model) == 8
    model.config.use_sliding_window = False  # without layer_types transformers masks by sliding_window alone
    assert attention_windows(model) == 8
    model.config.layer_types = ["sliding_attention", "full_attention"]
    model.config.use_sliding_window, model.config.sliding_window = True, 8
    assert attention_windows(model) == {"sliding_attention": 8, "full_attention": None}
    model.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"^model: expected layers of full or sliding-window attention .*linear"):
        StaticDecoder(model, 1, 16)
    from kbit.hf.decode import static_unsupported

    assert "linear_attention" in static_unsupported(model)  # generate_tokens' default then: the dynamic cache
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert static_unsupported(model) is None


def test_decode_attention_argument():
    """``decode_attention`` picks the one-token attention (on the CPU every choice runs SDPA: same tokens and
    logits); an unknown choice is refused before anything is built."""
    model = llama()
    with pytest.raises(ValueError, match="decode_attention"):
        StaticDecoder(model, 1, 16, decode_attention="flash")
    ids = torch.tensor(PROMPT)
    want_t, want_l = static_greedy(model, ids, 4)
    for choice in ("kbit", "sdpa"):
        t, lg = static_greedy(model, ids, 4, decode_attention=choice)
        assert torch.equal(t, want_t)
        assert torch.equal(lg, want_l)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_gpu_fast_step_matches_transformers(arch):
    """The fast step (glue kernels with PDL, the split-KV attention) against transformers' forward, bf16 k = 4, in
    CUDA graphs; the fast step's graph replay equals its eager run."""
    model = {"llama": lambda: llama(vocab=256), "qwen3": qwen3, "qwen3_moe": qwen3_moe}[arch]()
    model = model.to(device="cuda", dtype=torch.bfloat16)
    if arch == "qwen3_moe":
        use_kbit_moe(model, k=4)
        quantize_model(model, k=4, include=[r"self_attn\.(q|k|v|o)_proj"], progress=False)
    else:
        quantize_model(model, k=4, progress=False)
    ids = torch.tensor(PROMPT, device="cuda")
    ref_t, ref_l = static_greedy(model, ids, 8, graph=True, fast=False)
    eager_t, eager_l = static_greedy(model, ids, 8, graph=False, fast=True)
    graph_t, graph_l = static_greedy(model, ids, 8, graph=True, fast=True)
    assert torch.equal(graph_t, eager_t)
    torch.testing.assert_close(graph_l, eager_l, atol=1e-2, rtol=1e-2)
    assert (graph_t == ref_t).float().mean() >= 0.8  # bf16 rounding of a different attention kernel
    rel = (graph_l[:3] - ref_l[:3]).norm() / ref_l[:3].norm()
    assert rel < 2e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("model_type, kw, blocks", [
    ("deepseek_v3", dict(n_routed_experts=8, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                         first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16, head_dim=8), 1),
    ("qwen2_moe", dict(num_experts=4, shared_expert_intermediate_size=64), 2),
])
def test_gpu_use_kbit_moe_reproduces_the_block(model_type, kw, blocks):
    """On the GPU in bf16 the check before each swap passes for blocks KbitMoE reproduces (its tolerance holds
    two kernel paths over the same k-bit experts), and the logits stay those of transformers' blocks."""
    model = _moe_model(model_type, **kw).to(device="cuda", dtype=torch.bfloat16)
    x = torch.tensor(PROMPT[:1], device="cuda")
    with torch.no_grad():
        want = model(x).logits.float()
    assert use_kbit_moe(model) == blocks
    with torch.no_grad():
        got = model(x).logits.float()
    assert (got - want).norm() / want.norm() < 2e-2


@pytest.mark.gpu
def test_gpu_gpt_oss_experts():
    """gpt-oss's experts (transposed, biased, their own gate) through KbitExperts on the GPU, bf16 k = 4: the
    logits of the float model holding the same rounded weights."""
    from kbit.hf.experts import source_stacks
    from kbit.ops.dequant import dequantize
    from kbit.ops.quantize import quantize

    model = tiny_lm("gpt_oss", intermediate_size=64, num_local_experts=4, layer_types=None)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    names = [n for n, m in model.named_modules() if type(m).__name__ == "GptOssExperts"]
    saved = {}
    for n in names:  # the float model holding what k = 4 rounds the experts to, then the originals back
        m = model.get_submodule(n)
        gu, dn = source_stacks(m)
        for w, t in (("gate_up_proj", gu), ("down_proj", dn)):
            saved[(n, w)] = getattr(m, w).data
            r = dequantize(quantize(t, k=4), torch.float32).transpose(1, 2).to(torch.bfloat16)
            getattr(m, w).data = r.contiguous()
    x = torch.tensor(PROMPT[:1], device="cuda")
    with torch.no_grad():
        want = model(x).logits.float()
    for (n, w), v in saved.items():
        getattr(model.get_submodule(n), w).data = v
    quantize_model(model, k=4, overrides={r"self_attn\.(q|k|v|o)_proj": None}, progress=False)  # experts only
    assert all(isinstance(model.get_submodule(n), KbitExperts) for n in names)
    with torch.no_grad():
        got = model(x).logits.float()
    assert (got - want).norm() / want.norm() < 2e-2
