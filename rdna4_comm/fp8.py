"""The FP8 rule of dispatch: :func:`quantize_fp8` and :func:`dequantize_fp8`,
in plain torch (any device; eager and ``torch.compile`` give the same bits).
``rdna4_comm.reference`` and the package export them: this is the rule that
FP8 dispatch applies to bf16 rows (docs/semantics.md, "FP8 quantisation").

Per token and block of ``block`` consecutive channels (the last block may be
shorter): ``amax = max |fp32(x)|`` over the block, ``scale = max(amax,
1e-12) / 448`` in fp32 (1e-12 rounded to fp32; 448 is the largest finite
``torch.float8_e4m3fn``), ``q = fp32(x) / scale`` (IEEE division) rounded to
nearest even into ``torch.float8_e4m3fn`` by torch's conversion, which
saturates at +-448.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12
DEFAULT_BLOCK = 128
_PAYLOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_block(op: str, block) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{op}: block must be an int >= 1 (channels per scale), got {block!r}")


def num_scales(hidden: int, block: int = DEFAULT_BLOCK) -> int:
    """Scales per token of ``hidden`` channels: ceil(hidden / block)."""
    return -(-hidden // block)


def quantize_fp8(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` of x by the FP8 rule (module docstring).

    Args:
        x: [..., H] torch.float32, torch.bfloat16 or torch.float16, H >= 1.
        block: channels per scale.

    Returns:
        ``q``: [..., H] torch.float8_e4m3fn; ``scales``: [..., ceil(H / block)]
        torch.float32, both on x's device. A block of zeros has scale
        1e-12 / 448 and q = +-0 (signs kept); a NaN makes its block's scale
        and every q of the block NaN; an infinity makes its block's scale
        infinite, its own q NaN and the block's finite values +-0.
    """
    _check_block("quantize_fp8", block)
    if not isinstance(x, torch.Tensor) or x.dtype not in _PAYLOAD_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"quantize_fp8: x must be a torch.float32, torch.bfloat16 or torch.float16 tensor, got {got}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"quantize_fp8: x must have shape [..., H] with H >= 1, got {tuple(x.shape)}")
    H = x.shape[-1]
    blocks = num_scales(H, block)
    x32 = x.float()
    magnitude = x32.abs()
    if blocks * block != H:  # zeros leave every block's amax as it is
        magnitude = torch.nn.functional.pad(magnitude, (0, blocks * block - H))
    amax = magnitude.unflatten(-1, (blocks, block)).amax(-1)
    # A tensor divisor: torch divides a CUDA tensor by a Python number as a
    # multiplication by its reciprocal, which is not the IEEE quotient.
    scales = torch.clamp_min(amax, AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)
    # Each channel's scale by index: the form that torch.compile gets right
    # for H not a multiple of block (repeat_interleave and pad/slice do not).
    per_channel = scales[..., torch.arange(H, device=x.device) // block]
    return (x32 / per_channel).to(FP8_DTYPE), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                   block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``to_dtype(fp32(q) * scale)`` of each channel's block.

    Args:
        q: [..., H] torch.float8_e4m3fn.
        scales: [..., ceil(H / block)] torch.float32 (q's leading dimensions).
        dtype: torch.float32, torch.bfloat16 or torch.float16.
        block: channels per scale, as given to :func:`quantize_fp8`.

    Returns:
        [..., H] of ``dtype``. A block with an infinite scale (an infinity in
        the quantised row) dequantises to NaN.
    """
    _check_block("dequantize_fp8", block)
    if not isinstance(q, torch.Tensor) or q.dtype != FP8_DTYPE:
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise TypeError(f"dequantize_fp8: q must be a torch.float8_e4m3fn tensor, got {got}")
    if q.dim() < 1 or q.shape[-1] < 1:
        raise ValueError(f"dequantize_fp8: q must have shape [..., H] with H >= 1, got {tuple(q.shape)}")
    want = (*q.shape[:-1], num_scales(q.shape[-1], block))
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != want:
        got = (f"{scales.dtype} of shape {tuple(scales.shape)}" if isinstance(scales, torch.Tensor)
               else type(scales).__name__)
        raise ValueError(f"dequantize_fp8: scales must be torch.float32 of shape {want} "
                         f"(q's leading dimensions, ceil(H / {block})), got {got}")
    if scales.device != q.device:
        raise ValueError(f"dequantize_fp8: scales must be on q's device ({q.device}), got {scales.device}")
    if dtype not in _PAYLOAD_DTYPES:
        raise TypeError(f"dequantize_fp8: dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    per_channel = scales[..., torch.arange(q.shape[-1], device=q.device) // block]
    return (q.float() * per_channel).to(dtype)
