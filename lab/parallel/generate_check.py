"""``kbit generate`` under torchrun on GPUs (the README's command): a random Llama with Llama-3-8B-sized heads and a
word-level tokenizer written as a kbit checkpoint, then greedy text from one process and from two ranks.

    PYTHONPATH=src python lab/parallel/generate_check.py /tmp/kbit-gen-check   # writes the checkpoint
    kbit generate "w1 w2" --model /tmp/kbit-gen-check --temperature 0
    torchrun --nproc-per-node 2 --no-python kbit generate "w1 w2" --model /tmp/kbit-gen-check --temperature 0
"""

import sys

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from kbit.cli import main

out = sys.argv[1]
words = ["<unk>"] + [f"w{i}" for i in range(1, 256)]
tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tk.pre_tokenizer = pre_tokenizers.Whitespace()
tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
                                  max_position_embeddings=512)
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).save_pretrained(out + "-float")
tok.save_pretrained(out + "-float")
sys.exit(main(["quantize", out + "-float", out, "--k", "4"]))
