"""Checkpoints: atomic, validated, pruned; exact resume in sync mode; a SIGKILL never costs the
newest complete checkpoint."""

import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
from conftest import NUMBERS_ONLY, child_env, kill_session, launcher, only_on, own_lines, run_mpitrain, train

from mpitrain.core.config import UsageError
from mpitrain.duties import checkpoint
from mpitrain.duties.checkpoint import TrainState

FP = checkpoint.fingerprint((4, 3, 2), "adam")


def _state(step, n=5):
    return TrainState(np.arange(n, dtype=np.float32) + step, step, step,
                      {"m": np.ones(n, np.float32), "v": np.full(n, 2, np.float32)}, [step, step + 1])


def test_save_load_round_trip_without_pickle(tmp_path):
    path = checkpoint.save(tmp_path, _state(7), FP, keep=3)
    assert path.name == "ckpt-000000007.npz"
    with np.load(path, allow_pickle=False) as z:  # a plain .npz: no object arrays inside
        assert all(z[k].dtype != object for k in z.files)
    got = checkpoint.load(path, FP)
    assert got.global_step == 7 and got.positions == [7, 8]
    np.testing.assert_array_equal(got.params, _state(7).params)
    np.testing.assert_array_equal(got.opt_state["v"], np.full(5, 2))
    with np.load(path, allow_pickle=False) as z:  # the file layout of earlier versions: resumable by them too
        assert {"opt_t", "opt_m", "opt_v"} <= set(z.files)


def test_keeps_the_last_k_and_ignores_interrupted_saves(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, _state(step), FP, keep=2)
    (tmp_path / ".ckpt-000000005.npz.abc.tmp").write_bytes(b"half a save")
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-000000003.npz", "ckpt-000000004.npz"]
    path, st = checkpoint.load_latest(tmp_path, FP)
    assert st.global_step == 4


def test_a_checkpoint_keeps_each_workers_own_arrays_a_row_per_worker_and_refuses_rows_that_do_not_fit(tmp_path):
    state = _state(7)
    state.per_worker = {"residual": np.arange(10, dtype=np.float32).reshape(2, 5) / 7,
                        "inner_m": np.ones((2, 5), np.float32)}
    back = checkpoint.load(checkpoint.save(tmp_path, state, FP, keep=2), FP)
    assert back.per_worker.keys() == state.per_worker.keys()
    for name, rows in state.per_worker.items():
        np.testing.assert_array_equal(back.per_worker[name], rows)
    assert checkpoint.load(checkpoint.save(tmp_path / "none", _state(7), FP, keep=2), FP).per_worker == {}
    for bad in (np.zeros((2, 4), np.float32), np.zeros((2, 5), np.float64), np.full((2, 5), np.nan, np.float32),
                np.zeros((3, 5), np.float32)):  # another model's, another type, a diverged run's, other workers'
        state.per_worker["residual"] = bad
        with pytest.raises(UsageError, match="workers' own arrays .* that do not fit its parameters.*--fresh"):
            checkpoint.load(checkpoint.save(tmp_path / "bad", state, FP, keep=2), FP)


@only_on("mpich", NUMBERS_ONLY)
def test_a_resume_with_another_number_of_workers_does_not_resume_error_feedback_and_says_so(tmp_path):
    ck = tmp_path / "ck"
    args = ["--mode", "sync", "--compress", "int8", "--checkpoint-dir", str(ck)]
    train(3, tmp_path, *args, "--steps", "10")
    s = train(4, tmp_path, *args, "--steps", "20")
    assert s["resumed_from"].endswith("ckpt-000000010.npz") and s["global_step"] == 20
    assert ("each worker's own state (error feedback) is not resumed: the checkpoint kept it for 2 workers, this "
            "run has 3") in s["_stdout"]
    assert checkpoint.load(ck / "ckpt-000000020.npz").per_worker["residual"].shape[0] == 3


def test_truncated_checkpoint_is_a_usage_error_and_stays(tmp_path):
    path = checkpoint.save(tmp_path, _state(3), FP, keep=3)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UsageError, match="corrupt or truncated.*--fresh"):
        checkpoint.load(path, FP)
    assert path.exists()


def test_other_model_is_refused(tmp_path):
    path = checkpoint.save(tmp_path, _state(3), FP, keep=3)
    with pytest.raises(UsageError, match=r"another model or run \(model \{'kind': 'mlp', 'sizes': \[4, 3, 2\]\} vs "
                                         r"\{'kind': 'mlp', 'sizes': \[4, 8, 2\]\} here\)"):
        checkpoint.load(path, checkpoint.fingerprint((4, 8, 2), "adam"))
    with pytest.raises(UsageError, match="seed 0 vs 5 here"):
        checkpoint.load(path, checkpoint.fingerprint((4, 3, 2), "adam", seed=5))


def test_a_checkpoint_written_before_model_specs_still_resumes(tmp_path):
    """Checkpoints of earlier versions have no "model" in their fingerprint: a built-in model's
    layer sizes identify it, so they load (and one of other sizes is still refused)."""
    old = {k: v for k, v in FP.items() if k != "model"}
    path = checkpoint.save(tmp_path, _state(3), old, keep=3)
    assert checkpoint.load(path, FP).global_step == 3
    with pytest.raises(UsageError, match=r"layer_sizes \[4, 3, 2\] vs \[4, 8, 2\] here"):
        checkpoint.load(path, checkpoint.fingerprint((4, 8, 2), "adam"))


def test_checkpointer_schedule():
    class Cfg:
        checkpoint_dir, checkpoint_every_steps, checkpoint_every_secs, keep_checkpoints = "x", 10, 60.0, 3

    now = [0.0]
    c = checkpoint.Checkpointer(Cfg, FP, clock=lambda: now[0])
    assert c.due(10) and not c.due(11)
    now[0] = 61.0
    assert c.due(11)
    c.mark(11)
    assert not c.due(12)


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("optimizer,flags", [
    ("adam", "--compress none"), ("momentum", "--compress none"), ("adam", "--compress bf16"),
    # each worker's own arrays are in the checkpoint (Mode.worker_arrays): its error feedback, the outer exchange's
    # with --local-steps, and the inner optimizer's state
    ("adam", "--compress int8"), ("sgd", "--compress int4 --sparsify 5 --local-steps 4"),
    ("adam", "--compress int8 --compress-replies"),  # and the sums' error feedback (ScatterReducer)
    ("momentum", "--local-steps 4")])
def test_sync_resume_is_exact(tmp_path, optimizer, flags):
    args = ["--mode", "sync", "--optimizer", optimizer, "--lr", "0.01" if optimizer == "adam" else "0.05",
            *flags.split()]
    whole = train(3, tmp_path, *args, "--steps", "60")
    ck = tmp_path / "ck"
    first = train(3, tmp_path, *args, "--steps", "24", "--checkpoint-dir", str(ck))
    assert first["global_step"] == 24 and first["checkpoints"][-1].endswith("ckpt-000000024.npz")
    second = train(3, tmp_path, *args, "--steps", "60", "--checkpoint-dir", str(ck))
    assert "resuming from" in second["_stdout"] and second["resumed_from"].endswith("ckpt-000000024.npz")
    assert second["global_step"] == 60  # --steps counts from the start of training
    assert second["param_digest"] == whole["param_digest"]
    a = checkpoint.load_latest(ck, None)[1].params
    b = checkpoint.load(ck / "ckpt-000000060.npz").params
    np.testing.assert_array_equal(a, b)
    kept = checkpoint.load(ck / "ckpt-000000060.npz").per_worker  # a row for each worker, as the run left them
    assert {name: rows.shape for name, rows in kept.items()} == {
        **({"residual": (2, len(a))} if "int" in flags else {}),
        **({"sums": (2, len(a))} if "replies" in flags else {}),
        **({"inner_m": (2, len(a))} if "local" in flags and optimizer == "momentum" else {})}


@only_on("mpich", NUMBERS_ONLY)
def test_async_resume_continues_the_global_step(tmp_path):
    ck = tmp_path / "ck"
    train(3, tmp_path, "--steps", "100", "--checkpoint-dir", str(ck), "--checkpoint-every-steps", "40")
    assert [p.name for p in checkpoint.list_checkpoints(ck)] == ["ckpt-000000040.npz", "ckpt-000000080.npz",
                                                                  "ckpt-000000100.npz"]
    s = train(3, tmp_path, "--steps", "300", "--checkpoint-dir", str(ck))
    assert s["resumed_from"].endswith("ckpt-000000100.npz") and s["global_step"] == 300
    assert sum(s["worker_steps"]) == 300 and s["test_accuracy"] >= 0.9
    # the rates are this run's: 200 steps in its wall_seconds (they once counted the resumed 100 too)
    assert s["steps_per_second"] * s["wall_seconds"] == pytest.approx(200)


@only_on("mpich", NUMBERS_ONLY)
def test_sync_quorum_resume_continues_from_the_saved_step(tmp_path):
    """The quorum decisions (the chief worker's, rank 0's before) start at the resumed step, where
    the workers start (rank 0 once started at 0, ignored every READY and the job hung)."""
    ck = tmp_path / "ck"
    args = ["--mode", "sync", "--quorum", "2", "--optimizer", "adam", "--lr", "0.01", "--checkpoint-dir", str(ck)]
    train(4, tmp_path, *args, "--steps", "30")
    s = train(4, tmp_path, *args, "--steps", "70", timeout=60)
    assert s["resumed_from"].endswith("ckpt-000000030.npz") and s["global_step"] == 70
    assert sum(s["worker_steps"]) == 2 * (70 - 30)  # two gradients in each resumed step
    assert set(s["worker_param_digests"]) == {s["param_digest"]}


@only_on("mpich", NUMBERS_ONLY)
def test_local_run_checkpoints_and_fresh_keeps_the_old_ones(tmp_path):
    ck = tmp_path / "ck"
    train(0, tmp_path, "--steps", "30", "--checkpoint-dir", str(ck), "--checkpoint-every-steps", "10")
    assert len(checkpoint.list_checkpoints(ck)) == 3
    s = train(0, tmp_path, "--steps", "20", "--checkpoint-dir", str(ck), "--fresh")
    assert s["resumed_from"] is None and "--fresh: earlier checkpoints kept in" in s["_stdout"]
    aside = [p for p in ck.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and len(checkpoint.list_checkpoints(aside[0])) == 3


@only_on("mpich", NUMBERS_ONLY)
def test_corrupt_or_mismatched_checkpoint_exits_2_and_deletes_nothing(tmp_path):
    ck = tmp_path / "ck"
    train(3, tmp_path, "--steps", "20", "--checkpoint-dir", str(ck))
    proc = run_mpitrain(3, "--steps", "40", "--checkpoint-dir", str(ck), "--hidden", "50")
    assert proc.returncode == 2 and "another model" in proc.stderr and len(own_lines(proc.stderr)) == 1
    proc = run_mpitrain(3, "--steps", "40", "--checkpoint-dir", str(ck), "--seed", "3")
    assert proc.returncode == 2 and "seed 0 vs 3 here" in proc.stderr
    newest = checkpoint.list_checkpoints(ck)[-1]
    newest.write_bytes(newest.read_bytes()[:-50])
    before = sorted(p.name for p in ck.iterdir())
    proc = run_mpitrain(3, "--steps", "40", "--checkpoint-dir", str(ck))
    assert proc.returncode == 2 and "corrupt or truncated" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in ck.iterdir()) == before


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 60) -> None:
    """SIGKILL the whole job the moment ready() holds (polled every millisecond)."""
    deadline = time.time() + timeout
    while not ready():
        assert time.time() < deadline and proc.poll() is None, "the job never got there"
        time.sleep(0.001)
    kill_session(proc)  # mpirun and every rank (Open MPI's each in a process group of its own)
    proc.wait(timeout=30)


@only_on("mpich", NUMBERS_ONLY)
def test_sigkill_at_any_moment_leaves_the_newest_checkpoint_loadable(tmp_path):
    """Kill the whole job (rank 0 included) while it saves a ~6 MB checkpoint every few steps: the
    moment a save's temporary file appears (twice, so mid-write), and once between saves."""
    ck = tmp_path / "ck"
    model = ["--dataset", "synthetic", "--synthetic-features", "784", "--hidden", "2000"]
    big = [*model, "--steps", "100000", "--checkpoint-dir", str(ck), "--checkpoint-every-steps", "3",
           "--keep-checkpoints", "2", "--no-progress"]

    def writing(stale: set) -> set:  # temporary files of saves under way (not those a kill left)
        return {p.name for p in ck.iterdir() if p.name.endswith(".tmp")} - stale if ck.is_dir() else set()

    def newest() -> str:
        found = checkpoint.list_checkpoints(ck)
        return found[-1].name if found else ""

    def saving(stale: set, before: str) -> bool:  # this run has saved, and is saving again
        return newest() != before and bool(writing(stale))

    def between_saves(stale: set, before: str) -> bool:
        return newest() != before and not writing(stale)

    cut_short = 0  # kills that left a half-written save behind (measured: nearly every one aimed so)
    for when in (saving, saving, between_saves):
        stale = writing(set())  # what the previous kill left: the next resume must not mind it
        first = newest()
        proc = subprocess.Popen([*launcher(), "-np", "3", sys.executable, "-m", "mpitrain", *big],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(),
                                start_new_session=True)
        _kill_when(proc, lambda: when(stale, first))
        cut_short += bool(writing(stale))
        path, st = checkpoint.load_latest(ck, None)  # raises if the newest is not complete
        assert st.global_step > 0 and np.isfinite(st.params).all()
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None
    assert cut_short >= 1  # the test hit a save in the middle at least once
    resumed = train(3, tmp_path, *model, "--steps", str(st.global_step + 6), "--checkpoint-dir", str(ck))
    assert resumed["resumed_from"] is not None and resumed["global_step"] == st.global_step + 6


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_ema_is_evaluated_saved_and_restored(tmp_path, mode):
    ck = tmp_path / "ck"
    args = ["--mode", mode, "--ema-decay", "0.99", "--checkpoint-dir", str(ck), "--eval-every", "20"]
    s = train(3, tmp_path, *args, "--steps", "40")
    # another model than the raw one (losses, not accuracies: 359 test digits can tie, as seen once)
    assert 0.5 < s["ema_test_accuracy"] <= 1 and s["ema_test_loss"] != s["test_loss"]
    assert "EMA" in s["_stdout"] and all("ema_test_accuracy" in e for e in s["eval_history"])
    saved = checkpoint.load_latest(ck, None)[1]
    assert saved.ema is not None and not np.array_equal(saved.ema, saved.params)
    resumed = train(3, tmp_path, *args, "--steps", "60")
    assert resumed["resumed_from"] and resumed["ema_test_accuracy"] is not None
    if mode == "sync":  # the average continues from the saved one: same as one uninterrupted run
        whole = train(3, tmp_path, "--mode", "sync", "--ema-decay", "0.99", "--steps", "60")
        assert resumed["ema_test_accuracy"] == whole["ema_test_accuracy"]


def test_weight_ema_follows_tf_semantics():
    from mpitrain.core.optim import WeightEMA

    p = np.zeros(3, np.float32)
    ema = WeightEMA(0.99, p)
    p[:] = 1
    ema.update(p)  # t=0: decay min(0.99, 1/10) = 0.1
    np.testing.assert_allclose(ema.avg, 0.9)
    for _ in range(1000):
        ema.update(p)
    np.testing.assert_allclose(ema.avg, 1, atol=1e-4)


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_time_based_checkpoints(tmp_path, mode):
    ck = tmp_path / "ck"
    s = train(3, tmp_path, "--mode", mode, "--checkpoint-dir", str(ck), "--checkpoint-every-secs", "0.02",
              "--keep-checkpoints", "1000", "--dataset", "synthetic", "--steps", "400")
    steps = [checkpoint.load(p).global_step for p in checkpoint.list_checkpoints(ck)]
    assert len(steps) >= 3 and steps[-1] == 400 and steps == sorted(steps)
    assert len(s["checkpoints"]) == len(steps)


def test_an_optimizer_added_to_the_registry_is_stepped_saved_and_resumed_by_its_state_names(tmp_path, monkeypatch):
    """One function and one registry line: the config accepts it, checkpoints carry its state."""
    from mpitrain.core import optim
    from mpitrain.core.config import TrainConfig
    from mpitrain.core.config_checks import validate

    def signum(opt, params, grad, lr):
        s = opt.state["s"]
        s *= 0.9
        s += grad
        params -= np.float32(lr) * np.sign(s)

    monkeypatch.setitem(optim.REGISTRY, "signum", optim.OptimizerKind(("s",), signum, 0.1))
    cfg = validate(TrainConfig(optimizer="signum", ema_decay=0.9))
    assert checkpoint.state_arrays(cfg) == ["params", "opt_s", "ema"]
    params, opt = np.zeros(4, np.float32), optim.Optimizer("signum", 4)
    opt.step(params, np.array([1, -2, 0, 3], np.float32), 0.5)
    np.testing.assert_array_equal(params, [-0.5, 0.5, 0, -0.5])
    path = checkpoint.save(tmp_path, TrainState(params, 1, opt.t, dict(opt.state)), FP, keep=1)
    got = checkpoint.load(path, FP)
    again = optim.Optimizer("signum", 4)
    again.restore(got.opt_t, got.opt_state)
    assert again.t == 1 and np.array_equal(again.state["s"], opt.state["s"])
    flat = checkpoint.to_flat(got, ["params", "opt_s"])  # what the sync chief hands rank 0
    back = checkpoint.from_flat(flat, ["params", "opt_s"], 4, 1, [1])
    np.testing.assert_array_equal(back.opt_state["s"], opt.state["s"])


def test_pairs_broadcast_to_a_receiver_arrive_in_an_int64_buffer_made_for_them(monkeypatch):
    """bcast_pairs on a rank that is not the root: the buffer MPI fills is made int64 (a float one, made
    with np.empty and then cast, turned the garbage it held into a RuntimeWarning after a respawn).
    np.empty's garbage made NaN wherever it is float, as it was then."""
    import warnings

    real_empty = np.empty
    monkeypatch.setattr(checkpoint.np, "empty", lambda shape, dtype=float: (
        np.full(shape, np.nan) if np.dtype(dtype).kind == "f" else real_empty(shape, dtype)))

    from mpitrain.duties.checkpoint import bcast_pairs

    sent = [np.array([2], np.int64), np.array([[3, 4], [7, 9]], np.int64)]

    class Receiver:
        def Get_rank(self):
            return 1

        def Bcast(self, spec, root):
            buf, _ = spec
            assert buf.dtype == np.int64, buf.dtype
            buf[...] = sent.pop(0)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bcast_pairs(Receiver(), None, root=0) == [(3, 4), (7, 9)]
