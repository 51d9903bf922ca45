"""The rank layout: the one place that maps workers to MPI ranks."""

import pytest

from mpitrain.core.layout import CHIEF, PS_RANK, WORKER, Layout


def test_a_world_of_one_is_a_single_process_run_with_one_worker():
    lay = Layout(1)
    assert lay.single and lay.workers == 1 and lay.server_ranks == ()
    assert lay.worker_rank(0) == 0 and lay.worker_index(0) == 0
    assert lay.role(0) == CHIEF and lay.peers(0) == []
    assert not lay.is_server(0)


@pytest.mark.parametrize("size", [2, 3, 5, 16])
def test_rank_0_serves_and_the_others_work(size):
    lay = Layout(size)
    assert lay.server_ranks == (PS_RANK,) == (0,)
    assert lay.worker_ranks == tuple(range(1, size)) and lay.workers == size - 1
    for w, rank in enumerate(lay.worker_ranks):
        assert lay.worker_rank(w) == rank and lay.worker_index(rank) == w
        assert lay.role(rank) == WORKER and lay.peers(rank) == [0]
    assert lay.role(0) == CHIEF and lay.peers(0) == list(range(1, size))


def test_a_server_has_no_worker_index():
    with pytest.raises(ValueError):
        Layout(3).worker_index(0)


def test_every_server_watches_every_other_server_and_every_worker():
    """--num-ps 3: a shard's loss reaches every other server (each takes part in its take-over)."""
    lay = Layout(6, num_ps=3)
    assert lay.peers(1) == [0, 2, 3, 4, 5] and lay.peers(2) == [0, 1, 3, 4, 5]
    assert lay.peers(4) == [0, 1, 2]
