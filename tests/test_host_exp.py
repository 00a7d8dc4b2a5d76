"""The host forward's exp (``vexp`` in ``model/csrc/host_kernels.c``, over arrays as ``ds4_exp_rows``): the
attention weights and the experts' SwiGLU take their exp from it, so it is checked here against exp in
float64: within 2 ulp over its range, 0 / inf / NaN where it says, and each value's result independent of
where it sits in the array (a row's weights must not depend on its neighbours or on the array's length)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ds4serve.model import host_forward


@pytest.fixture(scope="module")
def exp_rows():
    lib = host_forward.library()
    if lib is None:
        pytest.skip("the native host forward does not build here")
    fn = lib.ds4_exp_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None

    def run(x: np.ndarray) -> np.ndarray:
        out = np.array(x, dtype=np.float32, copy=True)
        fn(out.ctypes.data, out.size)
        return out
    return run


def _ulps(got: np.ndarray, x: np.ndarray) -> np.ndarray:
    want = np.exp(x.astype(np.float64))
    return np.abs(got.astype(np.float64) - want) / np.spacing(want.astype(np.float32)).astype(np.float64)


def test_within_two_ulp_of_exp_over_its_range(exp_rows):
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-87.3, 88.0, 1_000_003, dtype=np.float32),
                        rng.uniform(-1.0, 1.0, 200_000).astype(np.float32),  # softmax weights near the max
                        -np.abs(rng.standard_normal(200_000)).astype(np.float32) * 8,
                        np.array([0.0, -0.0, 1e-30, -1e-30, -87.3, 88.0], dtype=np.float32)])
    err = _ulps(exp_rows(x), x)
    assert err.max() <= 2.0, (x[err.argmax()], err.max())
    assert exp_rows(np.zeros(3, np.float32)).tolist() == [1.0, 1.0, 1.0]


def test_zero_below_its_range_inf_above_nan_kept(exp_rows):
    x = np.array([-np.inf, -1e30, -87.31, -100.0, 88.01, 1e30, np.inf, np.nan], dtype=np.float32)
    got = exp_rows(x)
    assert got[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert np.isposinf(got[4:7]).all()
    assert np.isnan(got[7])


@pytest.mark.parametrize("length", [1, 5, 8, 15, 16, 17, 33, 70])
def test_each_value_on_its_own(exp_rows, length):
    rng = np.random.default_rng(length)
    x = (rng.standard_normal(length) * 20).astype(np.float32)
    whole = exp_rows(x)
    one_by_one = np.concatenate([exp_rows(x[i:i + 1]) for i in range(length)])
    shifted = exp_rows(np.concatenate([rng.standard_normal(3).astype(np.float32), x]))[3:]
    assert np.array_equal(whole, one_by_one) and np.array_equal(whole, shifted)
