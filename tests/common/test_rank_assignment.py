"""Rank assignment is consistent for any layout of tasks on hosts (property tests)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkhvd.runner import assign_ranks

pytestmark = pytest.mark.unit

hosts_lists = st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=24)


@settings(max_examples=200, deadline=None)
@given(hosts_lists)
def test_ranks_are_a_permutation_grouped_by_host(hosts):
    placements = assign_ranks(hosts)
    assert sorted(p.rank for p in placements) == list(range(len(hosts)))
    assert all(p.size == len(hosts) for p in placements)
    by_rank = sorted(zip(placements, hosts), key=lambda x: x[0].rank)
    seen, previous = [], None
    for _, host in by_rank:  # each host's ranks are contiguous
        if host != previous:
            assert host not in seen
            seen.append(host)
            previous = host


@settings(max_examples=200, deadline=None)
@given(hosts_lists)
def test_local_and_cross_fields(hosts):
    placements = assign_ranks(hosts)
    for p, host in zip(placements, hosts):
        same_host = [q for q, h in zip(placements, hosts) if h == host]
        assert p.local_size == len(same_host)
        assert sorted(q.local_rank for q in same_host) == list(range(len(same_host)))
        peers = [q for q in placements if q.local_rank == p.local_rank]  # one per host
        assert p.cross_size == len(peers)
        assert sorted(q.cross_rank for q in peers) == list(range(len(peers)))


def test_two_hosts_example():
    placements = assign_ranks(["h1", "h2", "h1", "h2", "h1"])
    assert [(p.rank, p.local_rank, p.local_size, p.cross_rank, p.cross_size) for p in placements] == [
        (0, 0, 3, 0, 2), (3, 0, 2, 1, 2), (1, 1, 3, 0, 2), (4, 1, 2, 1, 2), (2, 2, 3, 0, 1)]
