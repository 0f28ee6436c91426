"""Gradient compression: cast to a 16-bit type for the wire, back afterwards."""

from __future__ import annotations

import torch


class Compressor:
    """Compresses a tensor before a reduction and decompresses the result."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        """Returns the tensor to send and the context decompress needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """No compression (the default)."""


class _CastCompressor(Compressor):
    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor):
        if tensor.is_floating_point() and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, less precision)."""

    wire_dtype = torch.bfloat16


class Compression:
    """``Compression.none``, ``Compression.fp16``, ``Compression.bf16``, as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
