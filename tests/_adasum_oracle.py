"""A plain NumPy copy of Horovod's Adasum (adasum.h), the oracle of the Adasum tests.

``np_pair`` and ``np_tree`` are adasum.h written out in NumPy: dot products and norms summed in order in
float64, a coefficient of 1 below sqrt(DBL_MIN), the pair rounded to the dtype (float16 through float32, as
Horovod's AVX kernel), ranks combined at distance 1, 2, 4. Where every dot product is exact (integer-valued inputs
at np=2) results must equal it bit for bit; elsewhere the only difference is the order in which the sums are added
(``tolerance``).
"""

from __future__ import annotations

import math
import sys

import numpy as np

SQRT_DBL_MIN = math.sqrt(sys.float_info.min)


def np_pair(a: np.ndarray, b: np.ndarray, counts: list) -> np.ndarray:
    out = np.empty_like(a)
    offset = 0
    for n in counts:
        x, y = a[offset:offset + n].astype(np.float64), b[offset:offset + n].astype(np.float64)
        dot = anormsq = bnormsq = 0.0
        for xi, yi in zip(x.tolist(), y.tolist()):  # ComputeDotAndNormSqrds: in order, in double
            dot += xi * yi
            anormsq += xi * xi
            bnormsq += yi * yi
        acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= SQRT_DBL_MIN else 1.0
        bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= SQRT_DBL_MIN else 1.0
        if a.dtype == np.float16:  # ScaledAddfp16: float32 coefficients, fma(bcoeff, b, acoeff * a)
            scaled_a = np.float32(acoeff) * x.astype(np.float32)
            pair = (scaled_a.astype(np.float64) + np.float64(np.float32(bcoeff)) * y).astype(np.float32)
        else:
            pair = acoeff * x + bcoeff * y
        out[offset:offset + n] = pair.astype(a.dtype)
        offset += n
    return out


def np_tree(vectors: list, counts: list | None = None) -> np.ndarray:
    counts = [vectors[0].size] if counts is None else counts
    level = [np.asarray(v).reshape(-1) for v in vectors]
    while len(level) > 1:
        level = [np_pair(level[i], level[i + 1], counts) for i in range(0, len(level), 2)]
    return level[0]


def tolerance(vectors: list, counts: list) -> float:
    """How far the result may be from the oracle when the sums are added in another order.

    A dot product of n terms in float64 is within n * eps * |a| |b| of the oracle's (eps: float64's
    epsilon), so each coefficient is within about 2 n eps |b| / |a| and each result element within
    4 n eps max(|a|, |b|); an element rounded to the dtype differently (one ulp of the dtype) moves
    the next level's coefficients by as much in the dtype's epsilon. Per level of the tree, with
    the dtype's epsilon and the largest input norm (Adasum's results are never longer than the sum
    of the norms, at most ``len(vectors)`` times the largest).
    """
    eps = float(np.finfo(vectors[0].dtype).eps)
    levels = max(1, int(math.log2(len(vectors))))
    norm = max(float(np.linalg.norm(np.asarray(v, dtype=np.float64))) for v in vectors) * len(vectors)
    return levels * 4 * max(counts) * eps * norm


def assert_adasum(got, vectors: list, counts: list | None = None, exact: bool = False) -> None:
    flat = [np.asarray(v).reshape(-1) for v in vectors]
    counts = [flat[0].size] if counts is None else counts
    expected = np_tree(flat, counts)
    got = np.asarray(got).reshape(-1)
    assert got.dtype == expected.dtype
    if exact:
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=0,
                                   atol=tolerance(flat, counts))


def horovod_close(expected, got, dtype) -> bool:
    """Horovod's test_adasum_pytorch.py criterion: |expected - got| / |expected| / 100 < the dtype's eps."""
    expected, got = np.asarray(expected, np.float64), np.asarray(got, np.float64)
    return np.linalg.norm(expected - got) / np.linalg.norm(expected) / 100.0 < np.finfo(dtype).eps
