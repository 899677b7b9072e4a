"""A GEMM accumulated in fp32 from half-precision inputs, as TRL's fused head runs it (shared by both
safe-vocab backwards)."""

from __future__ import annotations

import torch

__all__ = ["addmm_fp32"]

# cuBLAS GEMMs of half inputs with an fp32 output (``out_dtype``) exist on CUDA from torch 2.8.
_MM_OUT_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 8)


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 ``acc`` without rounding the product to the inputs' half dtype: one cuBLAS
    half GEMM with fp32 output on CUDA (tensor cores, as TRL's fused head), an fp32 GEMM of the upcast inputs
    elsewhere (the same products: a half × half product is exact in fp32)."""
    if _MM_OUT_DTYPE and acc.is_cuda and a.dtype in (torch.float16, torch.bfloat16) and b.dtype == a.dtype:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())
