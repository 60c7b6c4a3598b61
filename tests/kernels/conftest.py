"""Triton kernels run on the CPU only in Triton's interpreter; the variable must be set
before the kernel module is imported (pytest imports this file first)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
