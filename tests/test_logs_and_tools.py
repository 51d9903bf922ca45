"""--log-dir (JSONL + TensorBoard), `mpitrain plot`, `mpitrain evaluate`."""

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from conftest import NUMBERS_ONLY, child_env, only_on, own_lines, run_mpitrain, train

from mpitrain.duties.evaluation import confusion_matrix

pytestmark = only_on("mpich", NUMBERS_ONLY)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for mode in ("async", "sync"):
        d = root / f"digits-{mode}"
        s = train(3, root, "--mode", mode, "--log-dir", str(d), "--eval-every", "20", "--log-every", "5",
                  "--checkpoint-dir", str(d / "ck"), "--ema-decay", "0.99")
        out[mode] = (d, s)
    return out


FAKE_TORCH = "Tensor = type('Tensor', (), {})\n"
LOG_WITH_TORCH_ABOUT = """
import sys
from pathlib import Path
if sys.argv[1] == "user":
    import torch  # a user's Model holds it already
from mpitrain.duties.metrics import RunLog
log = RunLog(sys.argv[2], {"start_step": 0}, 1)
log.close({"test_accuracy": 0.5})
print("torch" in sys.modules, sorted(p.name.split(".")[0] for p in Path(sys.argv[2]).iterdir()))
import torch  # importable again afterwards
print(torch.Tensor.__name__)
"""


@pytest.mark.parametrize("who", ["nobody", "user"])
def test_log_dir_does_not_import_pytorch_for_tensorboard(tmp_path, who):
    """tensorboardX's writer imports torch when it is installed: 3-5 s of rank 0's set-up (PyTorch
    2.14, 2 cores) while the workers wait, for nothing mpitrain uses. With a stand-in torch
    installed: --log-dir's writer leaves it alone, still writes TensorBoard's file, and torch stays
    importable; a torch the process already holds is left as it is."""
    pytest.importorskip("tensorboardX")
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    env = {**child_env(), "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", LOG_WITH_TORCH_ABOUT, who, str(tmp_path / "log")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    held, files = proc.stdout.splitlines()[0].split(" ", 1)
    assert held == str(who == "user") and "events" in files, proc.stdout  # events.jsonl and TensorBoard's file
    assert proc.stdout.splitlines()[1] == "Tensor"  # imported after the writer: there when asked for


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_jsonl_log_has_training_and_eval_events(two_runs, mode):
    d, s = two_runs[mode]
    events = [json.loads(line) for line in (d / "events.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "start" and events[0]["mode"] == mode
    train_ev = [e for e in events if e["event"] == "train"]
    if mode == "async":  # every --log-every steps; sync logs what the chief reports (every 0.2 s)
        assert [e["global_step"] for e in train_ev[:3]] == [5, 10, 15]
    for key in ("loss", "lr", "samples_per_second", "staleness", "worker_steps", "time"):
        assert key in train_ev[-1]
    evals = [e for e in events if e["event"] == "eval"]
    assert len(evals) == s["global_step"] // 20 and "ema_test_accuracy" in evals[-1]
    assert events[-1]["event"] == "end" and events[-1]["test_accuracy"] == s["test_accuracy"]


def test_tensorboard_events_are_readable(two_runs):
    tb = pytest.importorskip("tensorboardX")  # noqa: F841
    from tensorboardX.proto import event_pb2

    d, _ = two_runs["sync"]
    files = list(d.glob("events.out.tfevents.*"))
    assert len(files) == 1
    tags = set()
    data = files[0].read_bytes()
    pos = 0
    while pos < len(data):  # TFRecord framing: length, crc, payload, crc
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
        tags.update(v.tag for v in event.summary.value)
        pos += 12 + length + 4
    assert {"train/loss", "train/lr", "eval/test_accuracy", "eval/ema_test_accuracy"} <= tags


def test_plot_overlays_runs_in_a_png(two_runs, tmp_path):
    out = tmp_path / "curves.png"
    proc = run_mpitrain(0, "plot", str(two_runs["async"][0]), str(two_runs["sync"][0]), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    from PIL import Image

    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (1100, 750)
        colours = np.unique(np.asarray(img.convert("RGB")).reshape(-1, 3), axis=0)
        assert len(colours) > 20  # curves, not a blank canvas


def test_plot_of_runs_without_eval_every_draws_the_loss_and_says_why(tmp_path):
    """No --eval-every: the accuracy panels were empty and matplotlib warned about empty legends."""
    d = tmp_path / "run"
    train(3, tmp_path, "--steps", "60", "--log-dir", str(d), "--log-every", "5")
    out = tmp_path / "curves.png"
    proc = run_mpitrain(0, "plot", str(d), "-o", str(out))
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr
    assert "drawing the loss only; train with --eval-every N" in proc.stdout
    from PIL import Image

    with Image.open(out) as img:
        assert img.size == (1100, 375)  # one row of panels: the loss against steps and time


def test_plot_refuses_a_folder_without_log(tmp_path):
    proc = run_mpitrain(0, "plot", str(tmp_path), "-o", str(tmp_path / "x.png"))
    assert proc.returncode == 2 and "no events.jsonl" in proc.stderr and len(own_lines(proc.stderr)) == 1


def test_evaluate_prints_accuracy_and_confusion_matrix(two_runs, tmp_path):
    d, s = two_runs["sync"]
    ckpt = sorted((d / "ck").glob("ckpt-*.npz"))[-1]
    out = tmp_path / "eval.json"
    proc = run_mpitrain(0, "evaluate", str(ckpt), "--dataset", "digits", "--summary-json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "accuracy" in proc.stdout and "true\\pred" in proc.stdout
    e = json.loads(out.read_text())
    assert e["test_accuracy"] == pytest.approx(s["test_accuracy"])
    assert e["ema_test_accuracy"] == pytest.approx(s["ema_test_accuracy"])
    m = np.array(e["confusion_matrix"])
    assert m.shape == (10, 10) and m.sum() == e["test_examples"]
    assert np.trace(m) / m.sum() == pytest.approx(e["test_accuracy"])


def test_evaluate_takes_the_newest_checkpoint_of_a_folder(two_runs, tmp_path):
    d, s = two_runs["sync"]
    out = tmp_path / "eval.json"
    proc = run_mpitrain(0, "evaluate", str(d / "ck"), "--dataset", "digits", "--summary-json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["test_accuracy"] == pytest.approx(s["test_accuracy"])
    proc = run_mpitrain(0, "evaluate", str(tmp_path), "--dataset", "digits")
    assert proc.returncode == 2 and "holds no ckpt-*.npz checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_evaluate_refuses_a_dataset_of_another_shape(two_runs):
    d, _ = two_runs["async"]
    ckpt = sorted((d / "ck").glob("ckpt-*.npz"))[-1]
    proc = run_mpitrain(0, "evaluate", str(ckpt), "--dataset", "synthetic")
    assert proc.returncode == 2 and "784 features" in proc.stderr and "64-100-10" in proc.stderr


def test_confusion_matrix_counts():
    m = confusion_matrix(np.array([0, 1, 1, 2]), np.array([0, 1, 2, 2]), 3)
    assert m.tolist() == [[1, 0, 0], [0, 1, 1], [0, 0, 1]]


def test_evaluate_takes_the_checkpoints_own_dataset_and_says_so(tmp_path):
    """A synthetic run's checkpoint used to be evaluated on digits and refused ("evaluate it on the
    dataset it was trained on"); the fingerprint names the dataset, and synthetic data is made again
    from the checkpoint's seed and feature count."""
    ck, summary = tmp_path / "ck", tmp_path / "s.json"
    proc = run_mpitrain(0, "--dataset", "synthetic", "--synthetic-features", "20", "--seed", "7", "--steps", "200",
                        "--no-progress", "--checkpoint-dir", str(ck), "--summary-json", str(summary))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "eval.json"
    proc = run_mpitrain(0, "evaluate", str(ck), "--summary-json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "on synthetic test set" in proc.stdout and "the checkpoint's own" in proc.stdout
    assert json.loads(out.read_text())["test_accuracy"] == pytest.approx(json.loads(summary.read_text())["test_accuracy"])


def test_evaluate_finds_an_npz_checkpoints_data_from_another_folder(tmp_path):
    """Trained in one folder on `npz:data/mine.npz` (a relative path), evaluated from another: the
    checkpoint records where the file was (it once kept the file's name only, and the error told the
    user to create a file that existed). A file no longer there is named, with the flag that fixes it."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    train_dir, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (train_dir / "data").mkdir(parents=True)
    elsewhere.mkdir()
    np.savez(train_dir / "data" / "mine.npz", x_train=x[:1400], y_train=y[:1400], x_test=x[1400:], y_test=y[1400:])
    proc = run_mpitrain(0, "--dataset", "npz:data/mine.npz", "--steps", "100", "--no-progress",
                        "--checkpoint-dir", "ck", cwd=train_dir)
    assert proc.returncode == 0, proc.stderr
    proc = run_mpitrain(0, "evaluate", str(train_dir / "ck"), cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert "on npz:mine.npz" not in proc.stdout and "mine.npz test set" in proc.stdout
    (train_dir / "data" / "mine.npz").rename(train_dir / "moved.npz")
    proc = run_mpitrain(0, "evaluate", str(train_dir / "ck"), cwd=elsewhere)
    lines = own_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "which is not there now" in lines[0], proc.stderr
    assert "--dataset npz:PATH" in lines[0] and "np.savez" not in lines[0]
    proc = run_mpitrain(0, "evaluate", str(train_dir / "ck"), "--dataset", "npz:../project/moved.npz", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr


def test_evaluate_into_a_closed_pipe_ends_quietly(two_runs):
    """`mpitrain evaluate ck | head -2`: a reader that stopped reading used to get a BrokenPipeError
    traceback (and exit 1) after the lines it wanted."""
    import os
    import subprocess
    import sys

    d, _ = two_runs["sync"]
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "mpitrain", "evaluate", str(d / "ck")], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_training_into_a_closed_pipe_ends_quietly_and_as_it_would(tmp_path):
    """`python -m mpitrain | head -1`: the reader stops reading while rank 0 still writes its
    summary. The run goes on to its end (the final checkpoint is written, exit 0), with no
    BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    from mpitrain.duties import checkpoint

    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "mpitrain", "--steps", "20", "--no-progress", "--checkpoint-dir",
                               str(tmp_path / "ck")], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert [checkpoint.load(p).global_step for p in checkpoint.list_checkpoints(tmp_path / "ck")][-1:] == [20]


def test_eval_at_end_evaluates_the_same_parameters_without_taking_training_time(tmp_path):
    """--eval-at-end: rank 0 copies the parameters at each --eval-every step and evaluates the copies
    after training. Sync is deterministic, so the copies score exactly what evaluating at once scored
    at the same steps (the model's and the moving average's), the log gets every eval event, and the
    training seconds are the wall seconds less only the copies (evaluated at once, every evaluation's
    time is taken out)."""
    flags = ("--mode", "sync", "--eval-every", "10", "--ema-decay", "0.9", "--steps", "600")
    now = train(3, tmp_path, *flags)
    later = train(3, tmp_path, *flags, "--eval-at-end", "--log-dir", str(tmp_path / "log"))
    assert now["param_digest"] == later["param_digest"]
    scores = [[(e["global_step"], e["test_accuracy"], e["ema_test_accuracy"]) for e in s["eval_history"]]
              for s in (now, later)]
    assert scores[0] == scores[1] and len(scores[0]) == now["global_step"] // 10
    taken_out = [e["seconds"] - e["training_seconds"] for e in later["eval_history"]]
    assert taken_out == sorted(taken_out) and taken_out[-1] < 0.05, taken_out
    assert now["eval_history"][-1]["seconds"] - now["eval_history"][-1]["training_seconds"] > taken_out[-1]
    events = [json.loads(line) for line in (tmp_path / "log" / "events.jsonl").read_text().splitlines()]
    assert [e["global_step"] for e in events if e["event"] == "eval"] == [s for s, _, _ in scores[1]]
