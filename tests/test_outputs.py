"""A full disk or quota never costs a run: checkpoints, the log and the summary on a real, small,
full filesystem (a tmpfs, as root), and the write path with an injected OSError."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import NUMBERS_ONLY, only_on, run_mpitrain

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from support import fill  # noqa: E402  (the chaos suite's disk-full case fills a disk the same way)

from mpitrain.core.config import defaults
from mpitrain.core.exitcodes import ExitCode
from mpitrain.duties import checkpoint, outputs
from mpitrain.duties.checkpoint import Checkpointer, TrainState
from mpitrain.duties.metrics import RunLog
from mpitrain.duties.outputs import WRITES

MODES = {"async": (3, ()), "sync": (3, ("--mode", "sync")), "one process": (0, ())}


@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs, mounted for the test (root only: skipped otherwise, with the reason)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def mpitrain_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("mpitrain:")]


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_full_checkpoint_folder_never_ends_training(tmp_path, small_fs, mode):
    np_, flags = MODES[mode]
    ck, summary = small_fs / "ck", tmp_path / "s.json"
    # Each checkpoint of digits' MLP is ~31 KB: the first fits, the next ones do not.
    proc = run_mpitrain(np_, "--no-progress", *flags, "--steps", "600", "--checkpoint-every-steps", "100",
                        "--checkpoint-dir", str(ck), "--summary-json", str(summary))
    assert proc.returncode == ExitCode.OUTPUTS_INCOMPLETE, proc.stdout + proc.stderr  # the final one is missing
    assert "Traceback" not in proc.stderr
    failed = [x for x in mpitrain_lines(proc.stderr) if "not written" in x]
    assert len(failed) == 1, proc.stderr  # the first failure only; the rest are counted
    assert "No space left on device" in failed[0] and "the newest good one is ckpt-000000100.npz" in failed[0]
    s = json.loads(summary.read_text())
    assert s["global_step"] == 600 and s["test_accuracy"] > 0.8  # training finished
    assert s["write_errors"]["checkpoint"]["count"] >= 5
    assert s["write_errors"]["newest_checkpoint"].endswith("ckpt-000000100.npz")
    assert [p.name for p in ck.iterdir()] == ["ckpt-000000100.npz"]  # intact, and no temporary file left
    assert checkpoint.load(ck / "ckpt-000000100.npz").global_step == 100


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_full_log_folder_never_ends_training(tmp_path, small_fs, mode):
    np_, flags = MODES[mode]
    logs, summary = small_fs / "logs", tmp_path / "s.json"
    fill(small_fs, leave=12288)  # room for the lock, a block of events.jsonl and one of TensorBoard's file
    # --eval-every: 150 eval events (~200 bytes each) whatever the mode (sync logs its training
    # events at the chief's status rate only, so a fast run may write few of them).
    proc = run_mpitrain(np_, "--no-progress", *flags, "--steps", "3000", "--log-every", "1", "--eval-every", "20",
                        "--log-dir", str(logs), "--summary-json", str(summary))
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the log is not the result: the summary holds it
    assert "Traceback" not in proc.stderr
    failed = [x for x in mpitrain_lines(proc.stderr) if "not written" in x]
    assert 1 <= len(failed) <= 2 and "No space left on device" in failed[0]  # events.jsonl, maybe TensorBoard
    s = json.loads(summary.read_text())
    assert s["global_step"] == 3000 and s["write_errors"]["log"]["count"] > 0
    for line in (logs / "events.jsonl").read_text().splitlines():
        json.loads(line)  # every line whole: a failed write was cut back off


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_summary_that_cannot_be_written_goes_to_stdout(small_fs, mode):
    np_, flags = MODES[mode]
    fill(small_fs)
    proc = run_mpitrain(np_, "--no-progress", *flags, "--steps", "100", "--summary-json", str(small_fs / "s.json"),
                        "--timeline", str(small_fs / "t.json"))
    assert proc.returncode == ExitCode.OUTPUTS_INCOMPLETE, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "BAD TERMINATION" not in proc.stdout
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    s = json.loads(line)
    assert s["global_step"] == 100 and s["write_errors"]["summary"]["count"] == 1
    assert s["write_errors"]["timeline"]["count"] == 1 and not (small_fs / "t.json").exists()
    assert not (small_fs / "s.json").exists() and not list(small_fs.glob(".s.json.*"))


@only_on("mpich", NUMBERS_ONLY)
def test_an_unwritable_output_folder_is_refused_before_training(tmp_path, small_fs):
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for flag, path in (("--checkpoint-dir", small_fs / "ck"), ("--summary-json", small_fs / "s.json"),
                       ("--log-dir", a_file), ("--timeline", small_fs / "t.json")):
        proc = run_mpitrain(3, "--no-progress", flag, str(path), timeout=60)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        (line,) = mpitrain_lines(proc.stderr)
        assert flag in line and "Traceback" not in proc.stderr and "global step" not in proc.stdout


def test_a_failed_checkpoint_write_leaves_nothing_and_is_said_once(tmp_path, monkeypatch, capsys):
    outputs.reset()
    cfg = dataclasses.replace(defaults(), checkpoint_dir=str(tmp_path))
    ckpt = Checkpointer(cfg, checkpoint.fingerprint((2, 2), "sgd"))
    state = lambda step: TrainState(np.ones(6, np.float32), step, step, positions=[step])  # noqa: E731
    assert ckpt.save(state(10))

    def full(*args, **kwargs):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(np, "savez", full)
    assert not ckpt.save(state(20)) and not ckpt.save(state(30))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "checkpoint at global step 20 not written" in err[0]
    assert "the newest good one is ckpt-000000010.npz" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000010.npz"]  # no temporary file, nothing pruned
    assert WRITES.report()["checkpoint"]["count"] == 2 and not WRITES.incomplete
    assert not ckpt.save(state(40), final=True) and WRITES.incomplete


def test_a_failed_log_line_is_cut_back_off(tmp_path, capsys):
    outputs.reset()
    log = RunLog(str(tmp_path), {"start_step": 0}, every=1)
    real = log.jsonl

    class HalfWrite:
        def __getattr__(self, name):
            return getattr(real, name)

        def write(self, data):
            real.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    log.jsonl = HalfWrite()
    log.train(1, loss=1.0)
    log.jsonl = real
    log.train(2, loss=0.5)
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "train"] and events[1]["global_step"] == 2
    assert "--log-dir event not written: No space left on device" in capsys.readouterr().err


@only_on("mpich", NUMBERS_ONLY)
def test_a_plot_that_cannot_be_written_is_one_line(tmp_path, small_fs):
    from mpitrain.duties import plot

    events = [{"event": "train", "global_step": 1, "seconds": 0.1, "loss": 1.0},
              {"event": "eval", "global_step": 1, "seconds": 0.1, "test_accuracy": 0.5}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    fill(small_fs)
    assert plot.main([str(tmp_path), "-o", str(small_fs / "curves.png")]) == ExitCode.OUTPUTS_INCOMPLETE
    assert not list(small_fs.glob("curves*"))


def test_out_of_space_prunes_the_older_checkpoints_first_never_the_newest(tmp_path, monkeypatch, capsys):
    outputs.reset()
    cfg = dataclasses.replace(defaults(), checkpoint_dir=str(tmp_path), keep_checkpoints=3)
    ckpt = Checkpointer(cfg, checkpoint.fingerprint((2, 2), "sgd"))
    for step in (10, 20, 30):
        assert ckpt.save(TrainState(np.ones(6, np.float32), step, step, positions=[step]))
    real, calls = np.savez, []

    def full_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "savez", full_once)
    assert ckpt.save(TrainState(np.ones(6, np.float32), 40, 40, positions=[40]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000030.npz", "ckpt-000000040.npz"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "deleted to make room for global step 40" in err[0]
    assert WRITES.report()["checkpoint space"]["count"] == 1 and "checkpoint" not in WRITES.report()


@only_on("mpich", NUMBERS_ONLY)
def test_a_folder_already_full_at_start_is_refused_in_one_line(small_fs):
    fill(small_fs)
    proc = run_mpitrain(3, "--no-progress", "--checkpoint-dir", str(small_fs / "ck"), timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = mpitrain_lines(proc.stderr)
    assert "--checkpoint-dir" in line and "No space left on device" in line and "Traceback" not in proc.stderr
    assert not (small_fs / "ck" / ".mpitrain.lock").exists()
