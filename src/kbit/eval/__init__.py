"""Quality of quantized models (``kbit eval``): weight quantizers (:mod:`kbit.eval.methods`), the two
offline judges (:mod:`kbit.eval.judges`: all-MiniLM-L6-v2 embeddings, SmolLM2-135M perplexity/KL) and the
command (:mod:`kbit.eval.cli`). Needs the ``eval`` extra."""
