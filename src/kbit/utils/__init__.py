"""Helpers every layer shares: argument checks (:mod:`.checks`), caches keyed by tensors (:mod:`.cache`) and
device facts (:mod:`.device`). They import nothing of kbit but :mod:`kbit.options`."""
