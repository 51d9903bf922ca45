"""Stale async gradients: the defaults that follow the worker count (--overlap, --staleness-lr K) and
--delay-compensation (DC-ASGD, adaptive), as rules on arrays and in the async server."""

import json

import numpy as np
import pytest
from conftest import NUMBERS_ONLY, child_env, keep_going, mpi_impl, mpitrain_cmd, only_on, run_detached, train

from mpitrain.cli import parse_args
from mpitrain.core.config import AUTO_OVERLAP_MAX_WORKERS, DEFAULT_STALENESS_TOLERANCE
from mpitrain.core.optim import DC_EPS, DC_MEAN_SQUARE_DECAY, DelayCompensation, ServerUpdate, staleness_scaled_lr
from mpitrain.core.exitcodes import ExitCode

M = DC_MEAN_SQUARE_DECAY


def _expected(g, w_now, w_then, mean_square, t, lam):
    """The paper's formula, written out in float64: g + lam * g*g * (w_now - w_then) / sqrt(ms_hat)."""
    g, w_now, w_then = (np.asarray(a, np.float64) for a in (g, w_now, w_then))
    ms = M * mean_square + (1 - M) * g * g
    return g + lam * g * g * (w_now - w_then) / (np.sqrt(ms / (1 - M ** t)) + DC_EPS), ms


def test_the_gradient_is_corrected_towards_the_parameters_now():
    params = np.array([1.0, -2.0, 0.5], np.float32)
    dc = DelayCompensation(2.0, params, np, workers=2, version=10)
    sent_at_10 = params.copy()
    params -= np.float32([0.1, 0.2, -0.3])  # two updates by others (the server's own params, in place)
    g = np.array([0.5, -1.0, 0.25], np.float32)
    out = dc.compensated(g, worker=1, basis=10)
    want, ms = _expected(g, params, sent_at_10, 0.0, 1, 2.0)
    np.testing.assert_allclose(out, want, rtol=1e-5)
    assert not np.array_equal(out, g) and np.array_equal(g, [0.5, -1.0, 0.25])  # a new array; g untouched
    # The mean square carries over: the second gradient's scale is that of both.
    dc.was_sent(1, 12)
    sent_at_12 = params.copy()
    params += np.float32(0.05)
    out2 = dc.compensated(g * 2, worker=1, basis=12)
    want2, _ = _expected(g * 2, params, sent_at_12, ms, 2, 2.0)
    np.testing.assert_allclose(out2, want2, rtol=1e-5)


def test_lambda_zero_is_plain_async_bit_for_bit():
    params = np.linspace(-1, 1, 50, dtype=np.float32)
    dc = DelayCompensation(0.0, params, np, workers=1, version=0)
    params *= np.float32(0.9)
    g = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    assert np.array_equal(dc.compensated(g, 0, 0), g)


def test_with_overlap_the_parameters_two_replies_back_are_the_ones_used():
    """--overlap: a worker's gradient is computed on the reply before the newest; each worker's
    copies are its own, found by the version its gradient names, and older ones are let go."""
    params = np.zeros(4, np.float32)
    dc = DelayCompensation(1.0, params, np, workers=2, version=0)
    for version in (1, 2, 3):
        params += np.float32(1)
        dc.was_sent(0, version)
    assert sorted(dc.sent[0]) == [2, 3] and sorted(dc.sent[1]) == [0]  # two kept; worker 1 has its start copy
    np.testing.assert_array_equal(dc.sent[0][2], np.full(4, 2, np.float32))
    params += np.float32(1)  # now 4: worker 0's gradient on version 2 is two updates behind
    g = np.ones(4, np.float32)
    out = dc.compensated(g, 0, basis=2)
    want, _ = _expected(g, params, np.full(4, 2.0), 0.0, 1, 1.0)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    dc.compensated(g, 1, basis=0)  # worker 1's start copy is still there
    assert dc.uncompensated == 0
    dc.forget(0)  # a lost worker: nothing of it is kept, and a late gradient is applied as it is
    assert dc.compensated(g, 0, basis=3) is g and dc.uncompensated == 1


@only_on("mpich", NUMBERS_ONLY)
def test_lambda_zero_trains_as_plain_async_and_the_default_lambda_does_not(tmp_path):
    """One worker, so async is deterministic: LAMBDA 0 gives plain async's parameters bit for bit;
    the flag alone compensates (with --overlap every gradient is one update stale)."""
    args = ["--steps", "150", "--seed", "4"]
    plain = train(2, tmp_path, *args)
    zero = train(2, tmp_path, *args, "--delay-compensation", "0")
    on = train(2, tmp_path, *args, "--delay-compensation")
    assert zero["param_digest"] == plain["param_digest"]
    assert on["param_digest"] != plain["param_digest"]
    assert on["test_accuracy"] >= plain["test_accuracy"] - 0.02


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("np_,flags", [(5, []), (5, ["--num-ps", "2", "--optimizer", "momentum"])],
                         ids=["4-workers", "2-servers-momentum"])
def test_it_learns_on_digits_with_several_workers(tmp_path, np_, flags):
    s = train(np_, tmp_path, "--delay-compensation", *flags)  # 50 epochs: about 600 global steps
    assert s["test_accuracy"] >= 0.93, s["_stdout"]


def test_a_gradient_within_the_tolerance_steps_at_the_full_rate_and_an_older_one_at_k_over_its_staleness():
    k = DEFAULT_STALENESS_TOLERANCE
    assert staleness_scaled_lr(0.1, 0, k) == staleness_scaled_lr(0.1, int(k), k) == 0.1  # exactly: digests hold
    assert staleness_scaled_lr(0.1, int(2 * k), k) == pytest.approx(0.05)
    assert staleness_scaled_lr(0.1, 4, 1.0) == pytest.approx(0.025)  # K 1: Zhang et al.'s lr / staleness


@pytest.mark.parametrize("flags,staleness,step", [([], 16, 0.05), ([], 8, 0.1), (["--staleness-lr", "0"], 16, 0.1),
                                                  (["--staleness-lr"], 4, 0.025)])
def test_the_async_server_damps_by_the_configured_tolerance(flags, staleness, step):
    cfg, _ = parse_args(flags)
    params = np.zeros(3, np.float32)
    ServerUpdate(cfg, params, np, 0, 0, {}).apply(np.ones(3, np.float32), 0.1, staleness)
    np.testing.assert_allclose(params, -step, rtol=1e-6)


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("np_,flags,overlaps", [
    (3, [], True), (AUTO_OVERLAP_MAX_WORKERS + 2, [], False), (AUTO_OVERLAP_MAX_WORKERS + 2, ["--overlap"], True)],
    ids=["2-workers", f"{AUTO_OVERLAP_MAX_WORKERS + 1}-workers", f"{AUTO_OVERLAP_MAX_WORKERS + 1}-workers-overlap"])
def test_overlap_follows_the_worker_count_as_the_start_line_says(tmp_path, np_, flags, overlaps):
    """Up to AUTO_OVERLAP_MAX_WORKERS workers overlap (each gradient about 2W - 1 updates stale),
    above it they wait for each reply (about W - 1); --overlap keeps it on. The start line says which,
    and the staleness measured says it happened."""
    w = np_ - 1
    s = train(np_, tmp_path, "--steps", "400", *flags)
    said = [line for line in s["_stdout"].splitlines() if line.startswith(f"mpitrain: async, {w} workers: ")]
    assert len(said) == 1, s["_stdout"]
    assert said[0].split(": ", 2)[2].startswith("overlap" if overlaps else "no overlap"), said[0]
    assert f"more than {DEFAULT_STALENESS_TOLERANCE:g} updates stale" in said[0]
    mean = s["staleness"]["mean"]
    assert (mean > w) if overlaps else (mean < w), (mean, said[0])


def test_a_lost_worker_leaves_delay_compensation_to_the_others(tmp_path):
    """A worker SIGKILLed mid-run: the servers forget the parameters they sent it, and the others
    finish the budget with their own copies compensated (the summary and the exit code as without)."""
    summary = tmp_path / "s.json"
    proc, _ = run_detached(mpitrain_cmd(4, "--no-progress", "--steps", "3000", "--worker-timeout", "1",
                                        "--delay-compensation", "--summary-json", str(summary),
                                        launcher_flags=keep_going()),
                           env={**child_env(), "MPITRAIN_INJECT_KILL": "2:50"})
    assert proc.returncode == ExitCode.WORKER_LOST, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and not proc.leftovers
    s = json.loads(summary.read_text())
    assert [x["rank"] for x in s["lost_workers"]] == [2] and s["global_step"] == 3000
    assert s["test_accuracy"] > 0.9
