"""Divergence: a non-finite loss or gradient stops every rank, names the step and the worker,
and never reaches a checkpoint."""

import json

import numpy as np
import pytest

from conftest import child_env, run_mpitrain
from mpitrain import checkpoint


@pytest.mark.parametrize("np_,mode,extra", [(3, "async", []), (3, "sync", []), (0, "sync", []),
                                            (4, "sync", ["--mode", "sync"])])
def test_injected_nan_stops_training_and_keeps_the_last_good_checkpoint(tmp_path, np_, mode, extra):
    ck = tmp_path / "ck"
    rank = 0 if np_ == 0 else 2
    env = {**child_env(), "MPITRAIN_INJECT_NAN": f"{rank}:25"}
    summary = tmp_path / "s.json"
    proc = run_mpitrain(np_, "--mode", mode, *extra, "--no-progress", "--checkpoint-dir", str(ck),
                        "--checkpoint-every-steps", "5", "--summary-json", str(summary), env=env)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # every rank: mpirun reports the rank's code
    line = [ln for ln in proc.stderr.splitlines() if "diverged" in ln]
    assert len(line) == 1 and f"non-finite loss from worker rank {rank}" in line[0]
    s = json.loads(summary.read_text())
    step = s["diverged"]["global_step"]
    assert f"global step {step}" in line[0] and s["global_step"] == step
    assert "Traceback" not in proc.stderr
    newest = checkpoint.list_checkpoints(ck)[-1]
    assert str(newest) in line[0]
    for path in checkpoint.list_checkpoints(ck):
        assert np.isfinite(checkpoint.load(path).params).all()  # load() itself also refuses non-finite


def test_overflowing_learning_rate_is_caught(tmp_path):
    proc = run_mpitrain(3, "--lr", "1e30", "--no-progress")
    assert proc.returncode == 4 and "training diverged at global step" in proc.stderr
    assert "RuntimeWarning" not in proc.stderr


def test_checkpointer_never_writes_non_finite_parameters(tmp_path):
    class Cfg:
        checkpoint_dir, checkpoint_every_steps, checkpoint_every_secs, keep_checkpoints = str(tmp_path), 1, 60.0, 3

    c = checkpoint.Checkpointer(Cfg, checkpoint.fingerprint((2, 2), "sgd"))
    c.save(checkpoint.TrainState(np.ones(6, np.float32), 1, 1, positions=[1]))
    c.save(checkpoint.TrainState(np.full(6, np.nan, np.float32), 2, 2, positions=[2]))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-000000001.npz"]


def test_ranks_started_with_different_models_stop_before_training():
    """MPMD launch: rank 0 with one model, the workers with another (as a mixed install would)."""
    import subprocess
    import sys

    from conftest import mpirun_path

    cmd = [mpirun_path(), "-np", "1", sys.executable, "-m", "mpitrain", "--no-progress", ":",
           "-np", "2", sys.executable, "-m", "mpitrain", "--no-progress", "--hidden", "50"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "error on rank 1: it disagrees with rank 0 (layer_sizes [64, 50, 10] vs [64, 100, 10]" in proc.stderr
    assert "mpitrain done" not in proc.stdout
