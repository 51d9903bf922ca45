"""The seams a next feature plugs into, each used here: the sync step's reducer (NCCL would be
another), and (below) a user's own model through the API."""

import numpy as np
import pytest

from test_cli import FakeWorld


def sync_worker_context(*flags):
    """A sync worker's context (worker 0 of 2), as setup() makes it, without MPI."""
    from mpitrain.cli import parse_args
    from mpitrain.runtime import Node, setup

    cfg, _ = parse_args(["--mode", "sync", "--lr-scaling", "none", *flags])
    return setup(cfg, FakeWorld(1, 3), Node(1, 3, 2, 2))


class AsIfAnotherWorkerSentZeros:
    """A reducer standing in for MPI's: a second worker whose gradient and loss are zero."""

    def __init__(self):
        self.calls = 0

    def sum(self, buf) -> bool:
        self.calls += 1
        buf[-2] += 1.0  # its weight (SyncStep's buffer ends [..., loss, weight, stop vote])
        return True


def test_the_sync_step_sums_through_the_reducer_it_is_given():
    from mpitrain.gradients import GradientSource
    from mpitrain.sync import SyncStep

    ctx = sync_worker_context()
    params = ctx.model.init_params(0)
    reducer = AsIfAnotherWorkerSentZeros()
    step = SyncStep(ctx, params.copy(), reducer=reducer)
    loss = step.compute(GradientSource(ctx))
    grad, before = step.buf[: ctx.model.n_params].copy(), step.params.copy()
    mean_loss = step.reduce_and_apply(0)
    assert reducer.calls == 1 and mean_loss == pytest.approx(loss / 2)
    # The mean of its gradient and the other's zeros: half a step of its own.
    np.testing.assert_allclose(step.params, before - np.float32(ctx.lr_at(0)) * grad / 2, rtol=1e-5, atol=1e-7)


def test_without_a_reducer_a_lone_sync_worker_uses_mpi_s_and_applies_its_own_gradient():
    from mpitrain.gradients import GradientSource
    from mpitrain.sync import MPIReducer, SyncStep

    ctx = sync_worker_context()
    step = SyncStep(ctx, ctx.model.init_params(0))
    assert isinstance(step.reducer, MPIReducer) and step.reducer.sum(step.buf) is False  # no communicator: alone
    step.compute(GradientSource(ctx))
    grad, before = step.buf[: ctx.model.n_params].copy(), step.params.copy()
    step.reduce_and_apply(0)
    np.testing.assert_allclose(step.params, before - np.float32(ctx.lr_at(0)) * grad, rtol=1e-5, atol=1e-7)
