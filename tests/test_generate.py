"""The decode loop behind `kbit generate`, on a tiny random Llama through KbitLinear's CPU path."""

import pytest
import torch

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
