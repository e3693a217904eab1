"""ONNX Runtime's low-bit kernels against kiln's numpy reference of the same codes, on this machine, at M = 1, 2, 8
(small shapes; tools/kernel_conformance.py runs real ones); and the bound is tight enough that planted reference
bugs miss it."""

import numpy as np
import pytest

from kiln.compiler.quantize import conformance as c


@pytest.mark.parametrize("fmt", c.FORMATS, ids=lambda f: f.name.replace(" ", "-"))
def test_every_emitted_format_agrees_at_every_row_count(fmt):
    r = c.check(fmt, 256, 96)
    assert r["agrees"], f"{fmt.name} on this machine: error / bound per M {r['error_over_bound']}"
    assert set(r["error_over_bound"]) == {"1", "2", "8"}


def planted_error(fmt, mutate):
    """The worst |kernel - reference| / bound when the reference is computed from mutated inputs."""
    import tempfile
    from pathlib import Path

    rng = np.random.default_rng(0)
    codes, scales, zeros = c._codes(rng, fmt, 96, 256)
    a = rng.standard_normal((2, 256)).astype(np.float32)
    with tempfile.TemporaryDirectory() as d:
        got = c._session(fmt, codes, scales, zeros, 256, 96, Path(d), None).run(None, {"A": a})[0]
    want, absolute = mutate(fmt, a, codes, scales, zeros)
    return float((np.abs(got - want) / (c.RTOL * absolute)).max())


def test_the_bound_fails_a_reference_without_the_int8_step():
    fmt = c.FORMATS[0]  # 4-bit, accuracy level 4
    assert planted_error(fmt, lambda f, a, q, s, z: c.reference(f, a, q, s, z)) <= 1
    assert planted_error(fmt, lambda f, a, q, s, z: c.reference(f, a, q, s, z, int8=False)) > 10


def test_the_bound_fails_one_wrong_zero_point():
    fmt = next(f for f in c.FORMATS if f.zero_points and f.accuracy_level == 4)

    def wrong(f, a, q, s, z):
        z = z.copy()
        z[5, 0] = (z[5, 0] + 1) % 16  # one block of one column off by one code
        return c.reference(f, a, q, s, z)
    assert planted_error(fmt, wrong) > 10


def test_int8_rows_is_mlas_rounding():
    a = np.array([[127.0, 0.5, 1.5, -2.5, 0.0, 63.5, -127.0, 1.0]], np.float32)  # max 127: inverse scale 1
    q, scale = c.int8_rows(a, 8)
    assert q.tolist() == [[[127, 0, 2, -2, 0, 64, -127, 1]]]  # nearest even, as _mm256_cvtps_epi32
    assert scale.tolist() == [[1.0]]
