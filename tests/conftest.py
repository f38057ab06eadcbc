import os

import pytest
import torch

# Without a GPU, Triton kernels run through the interpreter on the CPU. The variable is read when a kernel
# is decorated, so it must be set before any kbit kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
