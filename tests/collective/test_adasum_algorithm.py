"""op=hvd.Adasum's algorithm alone, no processes: sparkhvd's pair, tree and hierarchical combination against the
NumPy oracle (tests/_adasum_oracle.py), and what Horovod refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _adasum_oracle import assert_adasum, np_pair, np_tree, tolerance

from sparkhvd.collective._core import _adasum

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_pair_and_tree_equal_the_numpy_oracle_bit_for_bit_where_sums_are_exact(dtype):
    rng = np.random.default_rng(3)
    vectors = [rng.integers(-8, 9, 12).astype(dtype) for _ in range(2)]
    counts = [5, 0, 7]  # three tensors, one of them empty: each its own coefficients
    got = _adasum.tree([torch.from_numpy(v) for v in vectors], counts).numpy()
    assert_adasum(got, vectors, counts, exact=True)
    whole = np_tree(vectors)  # one tensor of 12 gives other coefficients: the boundaries matter
    assert not np.array_equal(got, whole)


def test_tensors_longer_than_a_chunk_are_combined_whole_and_alike_whatever_the_threads():
    rng = np.random.default_rng(6)
    vectors = [rng.integers(-8, 9, 70001).astype(np.float32) for _ in range(2)]  # 3 chunks of 32768
    counts = [3, 69998]
    assert_adasum(_adasum.tree([torch.from_numpy(v) for v in vectors], counts).numpy(), vectors, counts, exact=True)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(100000, dtype=torch.float64, generator=g)  # correlated: coefficients near 0.5 feel an ulp
    randoms = [(k + 1) * base + torch.randn(100000, dtype=torch.float64, generator=g) for k in range(4)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _adasum.tree(randoms, [100000])
        torch.set_num_threads(4)  # one sum of 100000 float64 in 4 threads differs from one thread's (not chunked,
        # this tree then differs too)
        together = _adasum.tree(randoms, [100000])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)  # ranks with other thread counts still get the same bits


def test_the_tree_pairs_neighbours_then_pairs():
    rng = np.random.default_rng(4)
    vectors = [rng.normal(size=9) for _ in range(8)]
    got = _adasum.tree([torch.from_numpy(v) for v in vectors], [9]).numpy()
    assert_adasum(got, vectors)
    in_a_row = vectors[0]  # ((x0 + x1) + x2) + ...: another order, another result
    for v in vectors[1:]:
        in_a_row = np_pair(in_a_row, v, [9])
    assert np.abs(got - in_a_row).max() > 1e3 * tolerance(vectors, [9])


def test_zero_vectors_orthogonal_ones_add_and_parallel_ones_average():
    b = np.array([3.0, -4.0, 12.0])
    assert np.array_equal(_adasum.tree([torch.zeros(3, dtype=torch.float64), torch.from_numpy(b)], [3]).numpy(), b)
    assert np.array_equal(_adasum.tree([torch.zeros(3), torch.zeros(3)], [3]).numpy(), np.zeros(3))
    e = torch.eye(4, dtype=torch.float64)
    assert torch.equal(_adasum.tree(list(e), [4]), torch.ones(4, dtype=torch.float64))
    a = torch.tensor([1.0, 2.0, -2.0], dtype=torch.float64)
    assert torch.allclose(_adasum.tree([a, 3 * a, -a, 0.5 * a], [3]), (a + 3 * a - a + 0.5 * a) / 4, rtol=1e-15)


def test_hierarchical_sums_each_hosts_ranks_then_combines_the_hosts():
    rng = np.random.default_rng(5)
    vectors = [rng.normal(size=6) for _ in range(8)]  # 4 hosts of 2 ranks
    got = _adasum.hierarchical([torch.from_numpy(v) for v in vectors], [6], local_size=2).numpy()
    hosts = [vectors[i] + vectors[i + 1] for i in range(0, 8, 2)]
    assert_adasum(got, hosts)
    one_host = _adasum.hierarchical([torch.from_numpy(v) for v in vectors[:4]], [6], local_size=4).numpy()
    np.testing.assert_array_equal(one_host, ((vectors[0] + vectors[1]) + vectors[2]) + vectors[3])


def test_what_horovod_refuses_is_refused_with_the_numbers():
    assert _adasum.ranks_summed(False, 8, 4, True, "allreduce") == 1
    assert _adasum.ranks_summed(True, 8, 4, True, "allreduce") == 4
    with pytest.raises(NotImplementedError, match=r"allreduce\(op=hvd.Adasum\) combines ranks pairwise and needs "
                       r"a power-of-2 number of ranks, .* but this job has 6; run 1, 2, 4, 8"):
        _adasum.ranks_summed(False, 6, 2, True, "allreduce")
    with pytest.raises(NotImplementedError, match=r"on CUDA tensors combines hosts pairwise .* but this job has 3 "
                       r"hosts of 2 ranks; use 1, 2, 4, \.\.\. hosts"):
        _adasum.ranks_summed(True, 6, 2, True, "allreduce")
    with pytest.raises(NotImplementedError, match=r"needs every host to run the same number of ranks; this job's "
                       r"hosts run different numbers"):
        _adasum.ranks_summed(True, 3, 2, False, "grouped_allreduce")
    assert _adasum.dtype_problem([torch.ones(1), torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.bool)],
                                 "grouped_allreduce") == (
        "grouped_allreduce(op=hvd.Adasum) reduces float16, float32 and float64 tensors, as Horovod's, got bool, "
        "int32; cast them to a floating type, or use op=hvd.Sum or hvd.Average.")
