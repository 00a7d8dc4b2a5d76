"""The padded ``[in, out]`` layout the native kernels stream (model/host_support.py ``kn_stride``,
``kn_store``) and the FP8 decode over it (``native.fp8_native``).

Why padded: a row stride that is a multiple of 4 KiB puts the lines a register tile reads from
consecutive weight rows into one L1 set (the FP8 tile at 8 rows ran at ~35% of the FMA peak on a Zen 3
for it). The properties here are what the kernels and the torch path rely on: whole cache lines, an odd
count of them, never narrower than the weight, the values unchanged, the padding never read.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from ds4serve.model import native
from ds4serve.model.host_support import LINE, kn_store, kn_stored, kn_stride


@given(n_out=st.integers(1, 70_000), element_size=st.sampled_from([1, 2, 4]))
def test_the_stride_is_an_odd_count_of_whole_lines_at_most_two_more(n_out, element_size):
    stride = kn_stride(n_out, element_size)
    per_line = LINE // element_size
    assert stride >= n_out
    assert stride % per_line == 0
    assert (stride // per_line) % 2 == 1
    assert stride < n_out + 2 * per_line
    # 64 consecutive rows start in 64 different lines of a 4 KiB page: no two share an L1 set
    sets = {(r * stride * element_size // LINE) % 64 for r in range(64)}
    assert len(sets) == 64


@pytest.mark.parametrize("dtype,n_out,n_in", [(torch.float32, 1024, 24), (torch.float32, 40, 7),
                                              (torch.uint8, 4096, 9), (torch.uint8, 200, 3)])
def test_kn_store_keeps_the_values_and_zero_pads(dtype, n_out, n_in):
    g = torch.Generator().manual_seed(n_out + n_in)
    data = (torch.randn(n_out, n_in, generator=g) if dtype == torch.float32
            else torch.randint(0, 256, (n_out, n_in), generator=g, dtype=torch.uint8))
    assert not kn_stored(data)
    view = kn_store(data)
    assert torch.equal(view, data) and view.shape == data.shape
    assert kn_stored(view) and kn_store(view).stride() == view.stride()
    ld = view.stride(1)
    assert ld == kn_stride(n_out, data.element_size())
    full = torch.as_strided(view, (n_in, ld), (ld, 1))  # the whole buffer, padding included
    assert torch.count_nonzero(full[:, n_out:]) == 0


def _e4m3(code: int) -> float:
    """The value of an e4m3 code, from the format's definition (sign, exponent bias 7, 3 mantissa bits)."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 15, code & 7
    return sign * (math.ldexp(m / 8, -6) if e == 0 else math.ldexp(1 + m / 8, e - 7))


def test_fp8_decode_reads_the_padded_layout_as_the_format_says():
    if not native.enabled or native.library() is None:
        pytest.skip("no native kernels here (no C compiler)")
    g = torch.Generator().manual_seed(5)
    n_out, n_in, block = 256, 384, (128, 128)
    codes = torch.randint(0, 256, (n_out, n_in), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    scales = torch.exp2(torch.randint(-8, 3, (n_out // 128, n_in // 128), generator=g).float())
    padded = kn_store(codes)
    got = native.fp8_native(padded, scales, block)
    assert got is not None and got.shape == (n_out, n_in)
    want = torch.empty(n_out, n_in)
    for o in range(n_out):
        for i in range(n_in):
            want[o, i] = _e4m3(int(codes[o, i])) * float(scales[o // 128, i // 128])
    assert torch.equal(got, want)
