"""Suite-wide setup.

Without CUDA, Triton kernels run under Triton's CPU interpreter. TRITON_INTERPRET must be set before
anything imports triton (transformers does, from other test folders), so it is set here, first.
Nothing else reads it: the ops dispatch still sends CPU tensors to the PyTorch reference unless a
test forces the Triton backend.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
