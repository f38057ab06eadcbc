"""Launch keywords of the Triton glue and attention kernels for programmatic dependent launch (sm_90 and up): with
it the next kernel (a k-bit GEMV) starts loading its weights while these run. Shared by :mod:`kbit.ops.glue` and
:mod:`kbit.ops.attention`; imports no op."""
from __future__ import annotations

from kbit.cuda.runtime import pdl_enabled
from kbit.kernels import glue as _k

__all__ = ["launch_kw"]


def _pdl(device) -> bool:
    if device.type != "cuda":
        return False
    return _k.gdc_wait is not None and pdl_enabled(device)


def launch_kw(device) -> dict:
    """The ``PDL`` constexpr (and ``launch_pdl``) of a launch on ``device``."""
    return {"PDL": True, "launch_pdl": True} if _pdl(device) else {"PDL": False}
