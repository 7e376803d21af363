"""rc.quantize_fp8 / rc.dequantize_fp8, the FP8 rule of dispatch
(docs/semantics.md, "FP8 quantisation"): against a block-by-block oracle,
bitwise, on random rows of every payload dtype and of widths that are not a
multiple of the block; the edge cases with what they become; the round
trip's error; eager against torch.compile; bad arguments."""
from __future__ import annotations

import math

import pytest
import torch
from common import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdna4_comm as rc
from rdna4_comm import reference

FP8 = torch.float8_e4m3fn
SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, max_examples=examples(40))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same_or_both_nan(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equal, except that a NaN matches any NaN (its sign and
    payload are not part of the rule: docs/semantics.md)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(nan_a, nan_b), f"{what}: NaNs at different places"
    differ = (bits(a) != bits(b)) & ~nan_a
    assert not bool(differ.any()), f"{what}: {int(differ.sum())} elements differ, first at {differ.nonzero()[0].tolist()}"


def oracle(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule written block by block, for [T, H] x."""
    T, H = x.shape
    nb = math.ceil(H / block)
    q, scales = torch.empty(T, H, dtype=FP8), torch.empty(T, nb, dtype=torch.float32)
    floor, top = torch.tensor(1e-12, dtype=torch.float32), torch.tensor(448.0)
    for t in range(T):
        for b in range(nb):
            seg = x[t, b * block:(b + 1) * block].float()
            scale = torch.maximum(seg.abs().max(), floor) / top
            scales[t, b] = scale
            q[t, b * block:(b + 1) * block] = (seg / scale).to(FP8)
    return q, scales


@st.composite
def rows(draw):
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    T, H = draw(st.integers(0, 4)), draw(st.integers(1, 300))
    block = draw(st.sampled_from([1, 7, 128]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    # Magnitudes from 1e-8 to 1e4 per token, so scales span the floor and the fp8 range.
    magnitude = torch.pow(10.0, torch.empty(T, 1).uniform_(-8, 4, generator=g))
    return (torch.randn(T, H, generator=g) * magnitude).to(dtype), block


@SETTINGS
@given(case=rows())
def test_quantize_matches_the_rule_block_by_block(case):
    x, block = case
    q, scales = rc.quantize_fp8(x, block)
    q_ref, s_ref = oracle(x, block)
    assert q.dtype == FP8 and scales.dtype == torch.float32
    assert scales.shape == (x.shape[0], math.ceil(x.shape[1] / block))
    assert_same_or_both_nan(q, q_ref, "q")
    assert_same_or_both_nan(scales, s_ref, "scales")
    # The round trip: within half an fp8 step of each value (3 mantissa bits;
    # below the fp8 normals, half of the subnormal step, 2^-10 of the scale),
    # plus the rounding to the output dtype.
    for dtype in (torch.float32, torch.bfloat16):
        back = rc.dequantize_fp8(q, scales, dtype, block)
        per_channel = scales.repeat_interleave(block, -1)[:, : x.shape[1]]
        bound = x.float().abs() * 2.0**-4 + per_channel * 2.0**-10 + back.float().abs() * 2.0**-8
        assert bool(((back.float() - x.float()).abs() <= bound).all()), dtype


def test_edge_cases_become_what_the_contract_says():
    bf16_max = torch.finfo(torch.bfloat16).max
    x = torch.tensor([
        [0.0, -0.0, 0.0, -0.0],            # zeros: the floor's scale, signs kept
        [bf16_max, -bf16_max, 1.0, 0.0],   # the bf16 maximum: +-448, no NaN
        [1e-40, -1e-39, 2e-45, 0.0],       # subnormals: below the floor, q = +-0
        [1.0, float("nan"), 2.0, 3.0],     # NaN: the block's scale and every q NaN
        [float("inf"), 1.0, -2.0, float("-inf")],  # Inf: scale inf, +-Inf -> NaN, finite -> +-0
    ], dtype=torch.bfloat16)
    q, s = rc.quantize_fp8(x, block=4)
    floor_scale = torch.tensor(1e-12, dtype=torch.float32) / 448.0
    assert torch.equal(bits(s[0]), bits(floor_scale.reshape(1))) and torch.equal(bits(s[2]), bits(floor_scale.reshape(1)))
    assert bits(q[0]).tolist() == [0x00, 0x80, 0x00, 0x80]
    assert q[1].float().tolist()[:2] == [448.0, -448.0] and not bool(torch.isnan(q[1].float()).any())
    assert torch.equal(bits(s[1]), bits((torch.tensor(bf16_max, dtype=torch.float32) / 448.0).reshape(1)))
    assert bits(q[2]).tolist() == [0x00, 0x80, 0x00, 0x00]
    assert bool(torch.isnan(s[3]).all()) and bool(torch.isnan(q[3].float()).all())
    assert s[4].item() == math.inf
    assert torch.isnan(q[4].float()).tolist() == [True, False, False, True]
    assert bits(q[4]).tolist()[1:3] == [0x00, 0x80]
    back = rc.dequantize_fp8(q, s, torch.bfloat16, block=4)
    assert torch.equal(bits(back[0]), bits(x[0])) and torch.equal(bits(back[2]), bits(torch.tensor([0.0, -0.0, 0.0, 0.0], dtype=torch.bfloat16)))
    assert bool(torch.isnan(back[3]).all()) and bool(torch.isnan(back[4]).all())  # 0 * inf is NaN too


def float_patterns() -> torch.Tensor:
    """float32 values of every exponent and both signs, with mantissas on
    and around e4m3's rounding bit (bit 20), the ties below it, and random ones."""
    g = torch.Generator().manual_seed(7)
    steps = torch.arange(64, dtype=torch.int64) << 17
    mantissas = torch.cat([steps, steps + 1, (steps - 1).clamp_min(0), torch.arange(16),
                           torch.randint(0, 1 << 23, (512,), generator=g)])
    patterns = (torch.arange(256, dtype=torch.int64)[:, None] << 23) | mantissas[None, :]
    patterns = torch.cat([patterns, patterns | (1 << 31)]).flatten()
    return ((patterns + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32).view(torch.float32)


def test_the_kernels_conversion_is_torchs():
    """fp8.h's conversion (CPU transport and kernels), against torch's, on
    every value the rule can produce (|v| below 464, where torch versions
    agree) and NaN; larger magnitudes saturate at +-448."""
    f = float_patterns()
    mine = rc._C.testing.fp8_e4m3fn_bits(f)
    rule = (f.abs() < 464) | torch.isnan(f)
    assert torch.equal(mine[rule], f[rule].to(FP8).view(torch.uint8)), "conversion differs from torch's"
    big = torch.tensor([464.0, -464.0, 500.0, 1e30, -math.inf, math.inf])
    assert rc._C.testing.fp8_e4m3fn_bits(big).tolist() == [0x7E, 0xFE, 0x7E, 0x7E, 0xFE, 0x7E]


def test_the_device_conversion_is_fp8h_on_every_pattern(testing_extension):
    """The conversion the GPU kernels run (the hardware's where there is one,
    platform.h's fp8x4_bits) against fp8.h's, on all 2^32 fp32 patterns, on
    the device; two NaNs match."""
    count, lowest = testing_extension.fp8_conversion_mismatches(torch.cuda.current_device())
    assert count == 0, f"{count} fp32 patterns convert otherwise than fp8.h, the lowest 0x{lowest:08x}"


def test_the_division_free_quotient_gives_the_ieee_quotients_bytes(tmp_path):
    """fp8.h's fp8_quotient (a reciprocal per block and an FMA
    correction, what the CPU transport runs) gives the FP8 byte of the
    IEEE quotient x / scale wherever the rule divides, and the kernels'
    form of it (fp8_quotient_unsigned_zero, x's sign bit ORed into the
    byte) the same byte bit for bit: every bf16 and fp16 x against the
    scale of every bf16 and fp16 amax (about 2^30 pairs each), fp32 x at
    random and next to every FP8 rounding boundary; and fp8_scale (a
    product and an FMA correction) is the IEEE quotient amax / 448 on
    every non-negative fp32 amax."""
    import shutil
    import subprocess
    from pathlib import Path

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    root = Path(__file__).resolve().parents[1]
    fma = ["-mfma"] if " fma " in Path("/proc/cpuinfo").read_text() else []  # else the C library's fmaf: slower
    exe = tmp_path / "fp8_quotient_check"
    subprocess.run([cxx, "-std=c++17", "-O2", *fma, f"-I{root / 'csrc'}", "-o", str(exe),
                    str(root / "tests" / "fp8_quotient_check.cpp"), "-lpthread"], check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    lines = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()}
    assert set(lines) == {"bf16", "fp16", "fp32", "scale"}, res.stdout + res.stderr
    least = {"bf16": 1 << 29, "fp16": 1 << 29, "fp32": 1 << 24, "scale": 1 << 31}
    for case, (pairs, mismatches, x, amax, _) in lines.items():
        assert int(pairs) >= least[case], (case, pairs)
        assert int(mismatches) == 0, f"{case}: {mismatches} pairs give another byte, the first x = {x}, amax = {amax}"
    assert res.returncode == 0


@SETTINGS
@given(case=rows())
def test_the_transports_rows_are_the_rule(case):
    """The CPU transport's row quantiser (fp8.h, as the GPU kernels apply it)
    against rc.quantize_fp8, bitwise, at the dispatch block of 128."""
    x, _ = case
    q, scales = rc._C.testing.quantize_fp8_rows(x)
    q_ref, s_ref = rc.quantize_fp8(x)
    assert_same_or_both_nan(q, q_ref, "q")
    assert_same_or_both_nan(scales, s_ref, "scales")


def test_the_transports_rows_on_the_edge_cases():
    bf16_max = torch.finfo(torch.bfloat16).max
    x = torch.tensor([[0.0, -0.0] * 100, [bf16_max, -bf16_max] * 100, [1e-40, -1e-39] * 100,
                      [1.0, float("nan")] * 100, [float("inf"), -2.0] * 100], dtype=torch.bfloat16)
    q, scales = rc._C.testing.quantize_fp8_rows(x)
    q_ref, s_ref = rc.quantize_fp8(x)
    assert_same_or_both_nan(q, q_ref, "q")
    assert_same_or_both_nan(scales, s_ref, "scales")


@pytest.mark.parametrize("hidden", [100, 128, 300])
def test_compiled_gives_the_eager_bits(hidden):
    x = (torch.randn(5, hidden, generator=torch.Generator().manual_seed(hidden)) * 3).to(torch.bfloat16)
    x[1, 7] = float("nan")
    x[2, hidden - 1] = float("inf")
    q, s = rc.quantize_fp8(x)
    q_c, s_c = torch.compile(rc.quantize_fp8, fullgraph=True)(x)
    assert_same_or_both_nan(q_c, q, "compiled q")
    assert_same_or_both_nan(s_c, s, "compiled scales")
    back = rc.dequantize_fp8(q, s, torch.bfloat16)
    back_c = torch.compile(rc.dequantize_fp8, fullgraph=True)(q, s, torch.bfloat16)
    assert_same_or_both_nan(back_c, back, "compiled dequantize")


def test_leading_dimensions_and_the_exports():
    x = torch.randn(2, 3, 200).to(torch.bfloat16)
    q, s = rc.quantize_fp8(x)
    assert q.shape == (2, 3, 200) and s.shape == (2, 3, 2)
    flat_q, flat_s = rc.quantize_fp8(x.reshape(6, 200))
    assert torch.equal(bits(q.reshape(6, 200)), bits(flat_q)) and torch.equal(s.reshape(6, 2), flat_s)
    assert rc.quantize_fp8 is reference.quantize_fp8 and rc.dequantize_fp8 is reference.dequantize_fp8


BAD = {
    "block 0": (lambda: rc.quantize_fp8(torch.ones(2, 8), 0), ValueError, "block must be an int >= 1"),
    "block True": (lambda: rc.quantize_fp8(torch.ones(2, 8), True), ValueError, "block must be an int >= 1"),
    "integer x": (lambda: rc.quantize_fp8(torch.ones(2, 8, dtype=torch.int32)), TypeError,
                  "x must be a torch.float32, torch.bfloat16 or torch.float16 tensor, got torch.int32"),
    "0-dim x": (lambda: rc.quantize_fp8(torch.tensor(1.0)), ValueError, "x must have shape [..., H] with H >= 1"),
    "q not fp8": (lambda: rc.dequantize_fp8(torch.ones(2, 8), torch.ones(2, 1)), TypeError,
                  "q must be a torch.float8_e4m3fn tensor, got torch.float32"),
    "scales of the wrong shape": (lambda: rc.dequantize_fp8(torch.zeros(2, 200, dtype=FP8), torch.ones(2, 1)),
                                  ValueError, "scales must be torch.float32 of shape (2, 2)"),
    "scales of the wrong dtype": (lambda: rc.dequantize_fp8(torch.zeros(2, 8, dtype=FP8),
                                                            torch.ones(2, 1, dtype=torch.bfloat16)),
                                  ValueError, "scales must be torch.float32 of shape (2, 1)"),
    "output dtype": (lambda: rc.dequantize_fp8(torch.zeros(2, 8, dtype=FP8), torch.ones(2, 1), torch.int8),
                     TypeError, "dtype must be torch.float32, torch.bfloat16 or torch.float16, got torch.int8"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_arguments_raise_naming_them(case):
    call, error, text = BAD[case]
    with pytest.raises(error) as exc:
        call()
    assert text in str(exc.value), str(exc.value)
