"""Inputs and comparisons shared by the tests."""
from __future__ import annotations

import torch

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def rand(seed: int, rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Deterministic non-zero data for (seed, rank): never zeros, which hide unwritten outputs."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + 17)
    x = torch.randn(shape, generator=g) * 4
    return torch.where(x == 0, torch.ones_like(x), x).to(dtype)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.cpu(), expected.cpu()
    if a.dtype in INT_VIEW:
        a, e = a.view(INT_VIEW[a.dtype]), e.view(INT_VIEW[e.dtype])
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {a.numel()} elements differ bitwise; first at "
            f"{tuple(bad[0].tolist())}: {actual.cpu()[tuple(bad[0])]} != {expected.cpu()[tuple(bad[0])]}"
        )
