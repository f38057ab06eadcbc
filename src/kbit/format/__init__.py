"""The kbit weight format (version 2, docs/format.md): spec, codebooks, packing, plain-torch reference, files."""

from kbit.format.codebooks import DEFAULT_CODEBOOK
from kbit.format.spec import (
    BLOCKSIZES,
    DEFAULT_BLOCKSIZE,
    DEFAULT_K,
    DEFAULT_SCALE_FORMAT,
    FORMAT_VERSION,
    K_VALUES,
    MAX_ROTATION_BLOCK,
    SCALE_FORMATS,
    KbitWeight,
    Rotation,
)

__all__ = [
    "BLOCKSIZES", "DEFAULT_BLOCKSIZE", "DEFAULT_CODEBOOK", "DEFAULT_K", "DEFAULT_SCALE_FORMAT",
    "FORMAT_VERSION", "K_VALUES", "MAX_ROTATION_BLOCK", "SCALE_FORMATS", "KbitWeight", "Rotation",
]
