"""Test-session setup shared by every test.

Triton kernels are tested on CPU through the interpreter, which must be switched on before any
kernel module is imported; denormals are flushed because CPU float arithmetic on denormals is
orders of magnitude slower (recurrent scans decay states towards them).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_flush_denormal(True)
