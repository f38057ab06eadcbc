"""Pieces of the swap-AB tensor-core kernel family shared by its dense (``kbit.ops.gemv_mma``) and grouped
(``kbit.ops.grouped_mma``) launchers: the weight layout "mma-v1" (:mod:`.layout`) and launch helpers
(:mod:`.common`). Nothing here imports an op."""
