"""The Python API: mpitrain.train / evaluate, in one process and on every rank of an mpirun."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (MPI_TIMEOUT_S, OWN_LOGIC, Lines, child_env, keep_going, kill_session, launcher, mpi_impl,
                      only_on, run_detached)

from mpitrain.core.exitcodes import ExitCode

ROOT = Path(__file__).resolve().parent.parent


def python(code: str, np_: int = 0, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (MPI initialised there, not in pytest), under mpirun if np_."""
    cmd = [sys.executable, "-c", code]
    if np_:
        cmd = [*launcher(), "-np", str(np_), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=MPI_TIMEOUT_S, env=env or child_env(), cwd=ROOT)


@pytest.mark.parametrize("user_setting,threads", [(None, 1), ("2", 2)])
def test_the_api_pins_blas_to_one_thread_per_rank_as_the_cli_does(user_setting, threads):
    """A script that loaded NumPy before calling train() ran 3 ranks with a BLAS thread per core
    each, 6-14x slower than the CLI on 2 cores (issue 77): every rank now runs one BLAS thread,
    unless the user set the thread count."""
    from mpitrain.core.blas import BLAS_THREAD_VARS

    env = {k: v for k, v in child_env().items() if k not in BLAS_THREAD_VARS}
    if user_setting:
        env["OPENBLAS_NUM_THREADS"] = user_setting
    code = """
import numpy, threadpoolctl, sys, mpitrain
mpitrain.train(steps=5, progress=False)
blas = [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
sys.stdout.write(f"BLAS {mpitrain.rank()} {max(blas)}" + chr(10))
"""
    proc = python(code, np_=3, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = sorted(ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith("BLAS "))
    assert rows == [[str(r), str(threads)] for r in range(3)], proc.stdout


def test_train_in_one_process_returns_the_summary_and_runs_twice(tmp_path):
    code = f"""
import json, mpitrain
a = mpitrain.train(model="mlp", dataset="digits", epochs=5, progress=False, checkpoint_dir={str(tmp_path / 'ck')!r})
b = mpitrain.train(model="softmax", dataset="digits", steps=30, progress=False, hidden=50)
print("RESULT", json.dumps([a["mode"], a["test_accuracy"], a["global_step"], b["model_description"], b["global_step"]]))
e = mpitrain.evaluate(a["checkpoints"][-1], dataset="digits")
print("EVAL", json.dumps([e["test_accuracy"], e["global_step"]]))
"""
    proc = python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mode, acc, steps, model, steps_b = json.loads(proc.stdout.split("RESULT")[1].splitlines()[0])
    assert mode == "single" and acc > 0.85 and steps == 5 * (1438 // 100)
    assert model.startswith("softmax") and steps_b == 30
    eval_acc, eval_step = json.loads(proc.stdout.split("EVAL")[1].splitlines()[0])
    assert eval_acc == pytest.approx(acc) and eval_step == steps  # the final checkpoint is the run's end


@only_on("mpich", OWN_LOGIC)
def test_the_sweep_example_under_mpirun():
    proc = subprocess.run([*launcher(), "-np", "3", sys.executable, "examples/sweep_lr.py"], capture_output=True,
                          text=True, timeout=MPI_TIMEOUT_S, env=child_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("sweep:")]
    assert len(lines) == 3 and lines[-1] == "sweep: best lr 0.2"  # printed by rank 0 alone
    # each learning rate trains to something worth comparing (at 5 epochs lr 0.02 reached 0.59)
    assert min(float(ln.split()[-1]) for ln in lines[:2]) >= 0.85, lines
    assert proc.stdout.count("3 ranks: 1 PS + 2 workers") == 2  # two runs in one MPI job


@only_on("mpich", OWN_LOGIC)
def test_workers_get_their_report_and_divergence_raises():
    code = """
import sys, mpitrain
r = mpitrain.train(steps=40, progress=False, mode="sync")
sys.stdout.write(f"RANK {mpitrain.rank()} HAS {sorted(k for k in ('global_step', 'pushed', 'test_accuracy') if k in r)}" + chr(10))
try:
    mpitrain.train(lr=1e6, progress=False)
except mpitrain.Diverged as e:
    sys.stdout.write(f"DIVERGED {mpitrain.rank()} {e.summary is not None} {'rose to' in str(e)}" + chr(10))
"""
    proc = python(code, np_=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    has = sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("RANK"))
    assert has == ["RANK 0 HAS ['global_step', 'test_accuracy']", "RANK 1 HAS ['pushed', 'test_accuracy']",
                   "RANK 2 HAS ['pushed', 'test_accuracy']"]
    diverged = sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("DIVERGED"))
    assert diverged == ["DIVERGED 0 True True", "DIVERGED 1 False False", "DIVERGED 2 False False"]


def test_bad_options_raise_before_mpi():
    import mpitrain

    with pytest.raises(mpitrain.UsageError, match="^lr must be positive"):
        mpitrain.train(lr=-1)
    with pytest.raises(mpitrain.UsageError, match="^stragglers takes RANK:SECONDS"):
        mpitrain.train(stragglers=["x"])
    from mpitrain.api import config

    assert config(hidden="256,128").hidden == (256, 128) and config(hidden=50).hidden == (50,)
    assert config(hidden=[256, 128]).hidden == (256, 128)
    with pytest.raises(mpitrain.UsageError, match="hidden takes widths like 100, '256,128' or"):
        config(hidden="2x")
    assert config(mode="sync", stragglers=["2:x5"]).stragglers == ((2, "factor", 5.0),)
    assert config(lr=1).lr == 1.0 and isinstance(config(lr=1).lr, float)  # an int is a number
    import numpy as np  # a sweep's values: NumPy scalars are numbers too, stored as Python's

    swept = config(lr=np.float32(0.05), batch_size=np.int64(50), progress=np.bool_(False))
    assert (swept.lr, swept.batch_size, swept.progress) == (pytest.approx(0.05), 50, False)
    assert type(swept.batch_size) is int and type(swept.lr) is float and type(swept.progress) is bool


# (options, what the one line must say): a wrong type, a command-line-shaped name, a typo. Each
# of these used to end in a TypeError inside training, i.e. MPI_Abort, which kills a notebook.
BAD_OPTIONS = [
    ({"epochs": 1.5}, "epochs takes an integer or None, not 1.5; e.g. epochs=10"),
    ({"epochs": True}, "epochs takes an integer or None, not True"),
    ({"lr": "0.1"}, "lr takes a number or None, not '0.1'"),
    ({"progress": 1}, "progress takes True or False, not 1"),
    ({"mode": 3}, "mode takes a string, not 3; e.g. mode='async'"),
    ({"hidden": "100,,50"}, "hidden takes widths like"),
    ({"no_progress": True}, "unknown option no_progress; use progress=False"),
    ({"straggler": "2:x5"}, "unknown option straggler; use stragglers=[...]"),
    ({"batchsize": 10}, "unknown option batchsize; did you mean batch_size=?"),
]


# Which option is wrong is mpitrain's own check, before MPI starts; that the process can train after
# it is the MPI's: the first case runs under both MPIs, the others under MPICH.
@pytest.mark.parametrize("options,line", [pytest.param(o, ln, marks=() if i == 0 else only_on("mpich", OWN_LOGIC))
                                          for i, (o, ln) in enumerate(BAD_OPTIONS)],
                         ids=[next(iter(o)) + "=" + repr(v) for o, _ in BAD_OPTIONS for v in o.values()])
def test_a_bad_option_is_one_usage_error_and_the_caller_lives(options, line):
    """In a fresh interpreter, as a notebook would call it: UsageError with the line, no MPI_Abort,
    the process goes on (and can train right after)."""
    code = f"""
import mpitrain
try:
    mpitrain.train(**{options!r})
except mpitrain.UsageError as e:
    print("USAGE", e)
print("ALIVE", mpitrain.train(steps=2, progress=False)["global_step"])
"""
    proc = python(code)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"USAGE {line}" in proc.stdout and "ALIVE 2" in proc.stdout, proc.stdout


# A check written for the command line, raised to a caller of train(): in the keywords they passed.
IN_KEYWORDS = [
    ({"batch_size": 0}, "batch_size must be a positive integer (got 0); e.g. batch_size=100"),
    ({"mode": "sync", "staleness_lr": 2.0}, "staleness_lr applies to mode async"),
    ({"mode": "async", "quorum": 2}, "quorum applies to mode sync"),
    ({"overlap": False, "max_staleness": -1}, "max_staleness must be zero or more (got -1)"),
]


@pytest.mark.parametrize("options,line", IN_KEYWORDS, ids=[",".join(o) for o, _ in IN_KEYWORDS])
def test_a_check_of_the_flags_speaks_in_keywords_to_a_caller(options, line):
    import mpitrain
    from mpitrain.api import in_keywords

    with pytest.raises(mpitrain.UsageError) as e:
        mpitrain.train(**options)
    assert str(e.value).startswith(line) and "--" not in str(e.value), str(e.value)
    assert in_keywords("--no-overlap, not --oversubscribe; e.g. --dataset npz:my.npz") == \
        "overlap=False, not --oversubscribe; e.g. dataset='npz:my.npz'"  # mpirun's flags stay


def test_the_api_is_discoverable():
    """dir(), the signature (every TrainConfig field, with its default), the docstring, size()."""
    import dataclasses
    import inspect

    import mpitrain
    from mpitrain.core.config import TrainConfig

    assert {"train", "evaluate", "dataset", "rank", "size", "local_rank", "Model", "Result", "UsageError", "Diverged",
            "TrainingFailed", "__version__"} <= set(dir(mpitrain))
    params = inspect.signature(mpitrain.train).parameters
    fields = dataclasses.fields(TrainConfig)
    assert list(params) == [f.name for f in fields]
    assert all(params[f.name].default == f.default and params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
               for f in fields)
    doc = mpitrain.train.__doc__
    assert all(f"    {f.name}: " in doc for f in fields)
    assert "lr: learning rate; default the optimizer's: sgd 0.1, momentum 0.01, adam 0.001" in doc
    with pytest.raises(AttributeError):
        mpitrain.nonexistent


def test_size_and_local_rank_under_mpirun():
    """local_rank() is the launcher's: 0..2 on this one host (Open MPI numbers them in its own order)."""
    code = """
import os, sys, mpitrain
said = os.environ.get("MPI_LOCALRANKID", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK"))
sys.stdout.write(f"R {mpitrain.rank()} {mpitrain.size()} {mpitrain.local_rank()} {said}" + chr(10))
"""
    proc = python(code, np_=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = sorted(ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith("R "))
    assert [(r, n) for r, n, _, _ in rows] == [("0", "3"), ("1", "3"), ("2", "3")], rows
    assert sorted(local for _, _, local, _ in rows) == ["0", "1", "2"] and all(local == said for *_, local, said in rows)
    alone = python("import mpitrain; print('R', mpitrain.size(), mpitrain.local_rank())")
    assert "R 1 0" in alone.stdout, alone.stdout + alone.stderr


@only_on("mpich", OWN_LOGIC)
def test_a_spare_the_job_did_not_need_gets_a_result_saying_so_and_trains_again(tmp_path):
    """spares=1 under mpirun -np 4: the spare's train() returned nothing to build a result from (a
    TypeError, then hydra ended the job); now it says it was a spare that did not join, and the
    script's second train() splits off a spare again."""
    code = f"""
import mpitrain
for k in range(2):
    r = mpitrain.train(dataset="digits", steps=40, progress=False, spares=1, checkpoint_dir={str(tmp_path)!r} + f"/ck{{k}}")
    print(f"RUN {{k}} RANK {{mpitrain.rank()}}: {{r.get('spare')}} {{r.get('joined')}} {{r.get('global_step')}}", flush=True)
"""
    proc = python(code, np_=4)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for k in range(2):
        assert f"RUN {k} RANK 3: True False None" in proc.stdout, proc.stdout + proc.stderr
        assert f"RUN {k} RANK 0: None None 40" in proc.stdout and f"RUN {k} RANK 1: None None None" in proc.stdout


@only_on("mpich", OWN_LOGIC)
def test_train_returns_the_model_on_rank_0_and_predict_matches_the_summary():
    """No checkpoint needed: rank 0's result holds the final parameters; predicting the test set
    with them gives the summary's test accuracy, and their digest is the summary's."""
    code = """
import sys, hashlib, numpy as np, mpitrain
r = mpitrain.train(mode="sync", steps=60, progress=False)
if mpitrain.rank() == 0:
    data = mpitrain.dataset("digits")
    acc = float((r.predict(data.x_test) == data.y_test).mean())
    digest = hashlib.sha256(r.params.tobytes()).hexdigest()[:16]
    sys.stdout.write(f"ZERO {acc == r['test_accuracy']} {digest == r['param_digest']} {r.params.shape}" + chr(10))
else:
    sys.stdout.write(f"WORKER {r.params is None} {r.model is None}" + chr(10))
"""
    proc = python(code, np_=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(ln for ln in proc.stdout.splitlines() if ln.startswith(("ZERO", "WORKER")))
    assert lines == ["WORKER True True", "WORKER True True", "ZERO True True (7510,)"], proc.stdout


@only_on("mpich", OWN_LOGIC)
def test_bad_data_raises_usage_error_on_every_rank(tmp_path):
    code = f"""
import sys, mpitrain
try:
    mpitrain.train(dataset="npz:{tmp_path}/missing.npz")
except mpitrain.UsageError as e:
    sys.stdout.write(f"USAGE {{mpitrain.rank()}} {{'no such file' in str(e)}}" + chr(10))  # one write: ranks share stdout
"""
    proc = python(code, np_=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("USAGE")) == \
        ["USAGE 0 True", "USAGE 1 True", "USAGE 2 True"]
    assert "no such file" not in proc.stderr  # raised, not printed as well


def test_ctrl_c_in_the_api_saves_and_the_caller_lives_on(tmp_path):
    """A notebook's Ctrl-C: train() stops at a step, saves, raises TrainingFailed (130); the caller
    goes on with its own Ctrl-C back."""
    import os
    import signal
    import time

    from conftest import communicate_or_kill

    # Python's own Ctrl-C handler, as a terminal or a notebook has it: a child of a suite started in
    # the background (`nohup pytest &`) inherits SIGINT ignored, and Python then installs none.
    code = f"""
import signal, mpitrain
signal.signal(signal.SIGINT, signal.default_int_handler)
try:
    mpitrain.train(dataset="synthetic", steps=10**7, progress=False, checkpoint_dir={str(tmp_path / 'ck')!r})
except mpitrain.TrainingFailed as e:
    print("CODE", e.code, flush=True)
print("HANDLER", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), cwd=ROOT, start_new_session=True)
    line = ""
    while not line.startswith("rank 0 "):
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGINT)
    out, err = communicate_or_kill(proc)
    assert "CODE 130" in out and "HANDLER True" in out and "Traceback" not in err, out + err
    assert list((tmp_path / "ck").glob("ckpt-*.npz"))


def test_a_lost_worker_raises_lost_peer_with_the_summary_and_the_caller_lives_on(tmp_path):
    """Worker rank 2 dies at its step 5 (early: a rank starved on a busy machine did only 19 of 300
    steps once, and never reached step 40), async under -disable-auto-cleanup / ULFM: rank 0
    finishes the budget without it, and train() raises LostPeer carrying the summary and the model
    (it used to end the caller's process); the code after it runs on every survivor, and each then
    exits with the job's code without MPI_Finalize, which would wait for the dead rank. Under
    hydra it exits 137 as a rank killed by SIGKILL would (a script has no supervisor, and a rank killed by
    a signal takes the job with it there); under Open MPI it is SIGKILLed, as ULFM sees a real loss
    (an exit 137 is not reported as a failed process to the survivors' agreement: measured). Rank
    1 takes 2 s after the exception: prterun ends every rank once half of them are gone, so rank
    0's exit used to cut it short (api._leave)."""
    code = """
import time, mpitrain
try:
    mpitrain.train(steps=1000, worker_timeout=2, progress=False)
except mpitrain.LostPeer as e:
    r = e.result
    time.sleep(2 * (mpitrain.rank() == 1))
    lost = [w["rank"] for w in r["lost_workers"]] if mpitrain.rank() == 0 else None
    acc = r["test_accuracy"] if mpitrain.rank() == 0 else None
    print(f"after rank {mpitrain.rank()}: code {e.code} lost {lost} acc {acc} predicts {r.params is not None}", flush=True)
    assert "a second train() needs a new process" in str(e)
"""
    cmd = [*launcher(), *keep_going(), "-np", "3", sys.executable, "-c", code]
    dies = "MPITRAIN_INJECT_KILL" if mpi_impl().name == "openmpi" else "MPITRAIN_INJECT_EXIT"
    proc, _ = run_detached(cmd, env={**child_env(), dies: "2:5"}, timeout=90)
    out = proc.stdout
    assert "Traceback" not in proc.stderr and not proc.leftovers, proc.stderr
    assert "after rank 0: code 8 lost [2] acc 0." in out and "predicts True" in out, out + proc.stderr
    assert "after rank 1: code 0 lost None" in out, out + proc.stderr  # its own run was whole: its own code


SCRIPT = """
import sys, mpitrain
try:
    mpitrain.train(steps=20000, worker_timeout=2, progress=False)  # ~5 s: the kill comes 1 s in
    print(f"done rank {mpitrain.rank()}", flush=True)
except mpitrain.LostPeer as e:
    print(f"after rank {mpitrain.rank()}: code {e.code} args {sys.argv[1:]}", flush=True)
"""


@only_on("mpich", "the supervisor is hydra's (Open MPI's ULFM needs none: the test above)")
def test_mpitrain_run_gives_a_script_the_supervisor_and_a_worker_killed_from_outside_is_survived(tmp_path):
    """`mpitrain run script.py ARGS`: under hydra a plain `python script.py` has no supervisor, and a
    worker SIGKILLed from outside ended the whole job (issue 82). Run by mpitrain it is supervised as
    the CLI's ranks are: the script's next line runs on every survivor, with its own arguments, and
    mpirun exits with rank 0's verdict."""
    from mpitrain.launch.faults import rank_pids

    (tmp_path / "train.py").write_text(SCRIPT)
    cmd = [*launcher(), *keep_going(), "-np", "3", sys.executable, "-m", "mpitrain", "run", "train.py", "--x", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            cwd=tmp_path, start_new_session=True)
    lines = Lines(proc.stdout)
    try:
        assert lines.wait("rank 2 worker"), lines.text()
        time.sleep(1)
        os.kill(rank_pids(proc.pid)[2][0], signal.SIGKILL)  # the training process, as `kill -9` or the OOM killer
        proc.wait(MPI_TIMEOUT_S)
    finally:
        leftovers = kill_session(proc)
    out = lines.text()
    assert "after rank 0: code 8 args ['--x', '1']" in out and "after rank 1: code 0" in out, out
    assert "Traceback" not in out and not leftovers, out
    assert proc.returncode == ExitCode.WORKER_LOST, out


def test_mpitrain_run_refuses_a_script_that_is_not_there(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mpitrain", "run", "nope.py"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env=child_env())
    assert proc.returncode == 2 and "nope.py is not a file" in proc.stderr and "Traceback" not in proc.stderr
