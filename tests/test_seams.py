"""The seams a next feature plugs into, each used here: the sync step's reducer (NCCL would be
another), and (below) a user's own model through the API."""

import types

import numpy as np
import pytest
from conftest import NUMBERS_ONLY, only_on, own_lines
from test_cli import FakeWorld


def sync_worker_context(*flags):
    """A sync worker's context (worker 0 of 2), as setup() makes it, without MPI."""
    from mpitrain import modes
    from mpitrain.cli import parse_args
    from mpitrain.node import Node
    from mpitrain.runtime import setup

    cfg, _ = parse_args(["--mode", "sync", "--lr-scaling", "none", *flags])
    return setup(cfg, FakeWorld(1, 3), Node(1, 3, 2, 2), modes.of)


class AsIfAnotherWorkerSentZeros:
    """A reducer standing in for MPI's: a second worker whose gradient and loss are zero."""

    alone = False

    def __init__(self):
        self.calls = 0

    def sum(self, buf, part=None) -> bool:
        from mpitrain.modes.sync_slots import STAMP, SYNC_SLOTS, WEIGHT

        self.calls += 1
        n = len(buf) - SYNC_SLOTS
        buf[n + WEIGHT] += 1.0  # its weight, and the same step's stamp
        buf[n + STAMP] *= 2
        return True


def dealt_batches(ctx):
    """A fresh sync worker's batches of the job's deal (from step 0)."""
    from mpitrain.duties.checkpoint import TrainState
    from mpitrain.modes.gradients import DealtBatches, sync_deal

    return DealtBatches(ctx, sync_deal(ctx, TrainState(np.zeros(1, np.float32))))


def test_the_sync_step_sums_through_the_reducer_it_is_given():
    from mpitrain.modes.gradients import GradientSource
    from mpitrain.modes.sync_outer import step_for

    ctx = sync_worker_context()
    params = ctx.model.init_params(0)
    reducer = AsIfAnotherWorkerSentZeros()
    step = step_for(ctx, params.copy(), reducer=reducer)
    loss = step.compute(GradientSource(ctx, dealt_batches(ctx)))
    grad, before = step.buf[: ctx.model.n_params].copy(), step.params.copy()
    mean_loss = step.reduce_and_apply(0)
    assert reducer.calls == 1 and mean_loss == pytest.approx(loss / 2)
    # The mean of its gradient and the other's zeros: half a step of its own.
    np.testing.assert_allclose(step.params, before - np.float32(ctx.lr_at(0)) * grad / 2, rtol=1e-5, atol=1e-7)


class AsIfTheOtherDiedSendingIt(AsIfAnotherWorkerSentZeros):
    """MPICH's sum on a survivor when the other worker died half-way through its part: every weight,
    but `slot` holds what no worker sent (a stop vote nobody cast: CI's exit 143; a stamp of another step)."""

    def __init__(self, slot: str, value: float):
        super().__init__()
        self.slot, self.value = slot, value

    def sum(self, buf, part=None) -> bool:
        from mpitrain.modes import sync_step as sync

        super().sum(buf)
        buf[len(buf) - sync.SYNC_SLOTS + getattr(sync, self.slot)] = self.value
        return True


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("slot, value", [("VOTE", 0.37), ("VOTE", 3.0), ("ROOM_VOTE", 3.0), ("SAVE_VOTE", 3.0),
                                         ("STAMP", 2.0), ("STAMP", 0.0), ("WEIGHT", 1.0)])
def test_a_sum_whose_exact_slots_disagree_is_never_applied_nor_taken_for_a_stop(monkeypatch, slot, value):
    """A torn sum waits for rank 0's verdict on the worker that died in it (a regroup, or the job's end):
    the parameters are untouched and no stop is requested (on the old check, weight only, the 0.37 vote
    stopped the job as if signalled)."""
    from mpitrain.core.stop import STOP
    from mpitrain.modes import sync_step as sync
    from mpitrain.modes.gradients import GradientSource

    class Verdict(Exception):
        pass

    def await_verdict(ctx, why):
        raise Verdict(why)

    monkeypatch.setattr(sync, "await_verdict", await_verdict)
    STOP.reset()
    ctx = sync_worker_context()
    step = sync.SyncStep(ctx, ctx.model.init_params(0), reducer=AsIfTheOtherDiedSendingIt(slot, value))
    step.compute(GradientSource(ctx, dealt_batches(ctx)))
    before = step.params.copy()
    with pytest.raises(Verdict, match="stop votes|room votes|save votes|step stamp|weight"):
        step.reduce_and_apply(5)
    assert not STOP.due and not step.stop
    np.testing.assert_array_equal(step.params, before)


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("compress", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("workers", [2, 3, 16, 64])
def test_a_whole_sum_passes_the_check_on_every_wire_at_every_stamp(compress, workers):
    """Every worker's tail [loss, weight, stop, room and save votes, stamp] summed as MPI would through --compress's
    wire (its own SUM op for 16 bits) is never taken for a torn one: a false alarm would stall the job."""
    from mpitrain.core.codec import CODECS, decode, encode
    from mpitrain.modes.sync_slots import ROOM_VOTE, SAVE_VOTE, STAMP, SYNC_SLOTS, VOTE, WEIGHT, stamp_period, torn

    c = CODECS[compress]
    period = stamp_period(compress, workers)
    assert period >= 2  # a stale part of the step before always shows
    for step in range(2 * period):
        stamp = 1 + step % period
        acc = np.empty(SYNC_SLOTS, c.wire)
        for w in range(workers):  # worker 0 votes to stop and to save, every other one to make room
            part = np.empty(SYNC_SLOTS, c.wire)
            encode(np, np.array([0.37 * w, 1.0, float(w == 0), float(w != 0), float(w == 0), stamp], np.float32), part)
            if w == 0:
                acc[...] = part
            elif c.add is None:
                acc += part
            else:
                c.add(part, acc, None)
        tail = np.empty(SYNC_SLOTS, np.float32)
        decode(np, acc, tail)
        votes = float(tail[VOTE]), float(tail[ROOM_VOTE]), float(tail[SAVE_VOTE])
        assert torn(workers, float(tail[WEIGHT]), votes, float(tail[STAMP]), stamp) is None, (step, tail)


def test_without_a_reducer_a_lone_sync_worker_uses_mpi_s_and_applies_its_own_gradient():
    from mpitrain.exchange.mpi import MPIReducer
    from mpitrain.modes.gradients import GradientSource
    from mpitrain.modes.sync_outer import step_for

    ctx = sync_worker_context()
    step = step_for(ctx, ctx.model.init_params(0))
    assert isinstance(step.reducer, MPIReducer) and step.reducer.sum(step.buf) is False  # no communicator: alone
    step.compute(GradientSource(ctx, dealt_batches(ctx)))
    grad, before = step.buf[: ctx.model.n_params].copy(), step.params.copy()
    step.reduce_and_apply(0)
    np.testing.assert_allclose(step.params, before - np.float32(ctx.lr_at(0)) * grad, rtol=1e-5, atol=1e-7)


NO_MESSAGE_LOOP = """
import os, sys, json
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # as the command line pins them
    os.environ[var] = "1"
import dataclasses
import numpy as np
sys.path.insert(0, "tests")
from test_cli import FakeWorld
from mpitrain.duties import checkpoint
from mpitrain import modes
from mpitrain.duties.chief import ChiefDuties
from mpitrain.cli import parse_args
from mpitrain.modes.gradients import DealtBatches, GradientSource, sync_deal
from mpitrain.duties.metrics import Progress
from mpitrain.core.optim import ServerUpdate
from mpitrain.node import Node
from mpitrain.runtime import setup
from mpitrain.duties.summary import digest

cfg, _ = parse_args(sys.argv[1:])
ctx = setup(cfg, FakeWorld(0, 1), Node(0, 1, 1, 2), modes.of)
ctx = dataclasses.replace(ctx, start=checkpoint.TrainState(ctx.model.init_params(cfg.seed)))
duties = ChiefDuties(ctx, Progress(False, ctx.global_step_budget, ctx.global_batch))
params = duties.start.params.copy()
rule = ServerUpdate(cfg, params, np, 0, 0, {})
source, grad = GradientSource(ctx, DealtBatches(ctx, sync_deal(ctx, ctx.start))), np.empty_like(params)

def whole(step):
    return checkpoint.TrainState(params.copy(), step, rule.opt.t, dict(rule.opt.state), [step], rule.ema.avg.copy())

for step in range(1, ctx.global_step_budget + 1):
    loss = source.compute(params, grad)
    rule.apply(grad, ctx.lr_at(step - 1), staleness=0)
    duties.advance(step, loss, lambda evaluate, save: whole(step), staleness=0, worker_steps=[step])
duties.save(whole(step), final=True)
print(json.dumps({"param_digest": digest(params), "eval_history": duties.state.eval_history}))
"""


@only_on("mpich", NUMBERS_ONLY)
def test_a_server_with_no_message_loop_has_rank_0s_duties(tmp_path):
    """The server's side of the exchange seam needs no messages (what a shared-memory store or a
    GPU server would be): a plain loop that applies each gradient with the server's update rule
    (optim.ServerUpdate) and calls ChiefDuties.advance after each global step evaluates at
    --eval-every, saves at --checkpoint-every-steps and ends on the very parameters of the
    one-process run with the same flags."""
    import json
    import sys

    from mpitrain.duties import checkpoint

    flags = ["--optimizer", "momentum", "--lr", "0.05", "--ema-decay", "0.9", "--steps", "40", "--eval-every", "10",
             "--checkpoint-every-steps", "15"]
    ours = run_python_args([sys.executable, "-c", NO_MESSAGE_LOOP, *flags, "--checkpoint-dir", str(tmp_path / "ck")])
    assert ours.returncode == 0, ours.stderr
    loop = json.loads(ours.stdout.splitlines()[-1])
    assert [e["global_step"] for e in loop["eval_history"]] == [10, 20, 30, 40]
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "ck")] == [checkpoint.path_for(tmp_path, s).name
                                                                             for s in (15, 30, 40)]
    one = run_python_args([sys.executable, "-m", "mpitrain", *flags, "--no-progress", "--summary-json",
                           str(tmp_path / "one.json")])
    assert one.returncode == 0, one.stderr
    summary = json.loads((tmp_path / "one.json").read_text())
    assert loop["param_digest"] == summary["param_digest"]
    assert [e["test_accuracy"] for e in loop["eval_history"]] == [e["test_accuracy"] for e in summary["eval_history"]]


def run_python_args(cmd: list[str], cwd=None):
    import subprocess
    from pathlib import Path

    from conftest import MPI_TIMEOUT_S, child_env

    return subprocess.run(cmd, capture_output=True, text=True, timeout=MPI_TIMEOUT_S, env=child_env(),
                          cwd=cwd or Path(__file__).resolve().parent.parent)


# -- your own model through the API ----------------------------------------------------------------

def run_python(code: str, np_: int = 0, cwd=None):
    import sys

    from conftest import launcher

    cmd = [sys.executable, *(["-c", code] if "\n" in code else code.split())]
    if np_:
        cmd = [*launcher(), "-np", str(np_), *cmd]
    return run_python_args(cmd, cwd)


@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_custom_model_example_trains_in_each_mode(mode):
    proc = run_python(f"examples/custom_model.py {mode}", np_=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("custom model")]
    assert len(lines) == 1 and lines[0].startswith(f"custom model, {mode}: test accuracy"), proc.stdout  # rank 0 only
    assert float(lines[0].split("test accuracy ")[1].split(";")[0]) > 0.9
    assert "smoothed-logistic 64-10 (650 params)" in proc.stdout  # its description in the summary


@only_on("mpich", NUMBERS_ONLY)
def test_a_custom_model_checkpoints_resumes_and_evaluates_by_its_spec(tmp_path):
    """The checkpoint stores the model's spec: the same model resumes; another one (other
    smoothing) is refused; `mpitrain evaluate` says to use the API; the API evaluates it."""
    code = f"""
import sys
sys.path.insert(0, "examples")
import mpitrain
from custom_model import SmoothedLogistic
ck = {str(tmp_path / 'ck')!r}
a = mpitrain.train(model=SmoothedLogistic(64, 10), steps=30, checkpoint_dir=ck, progress=False)
b = mpitrain.train(model=SmoothedLogistic(64, 10), steps=60, checkpoint_dir=ck, progress=False)
print("RESUMED", b["resumed_from"].endswith("ckpt-000000030.npz"), b["global_step"], b["model"])
try:
    mpitrain.train(model=SmoothedLogistic(64, 10, smoothing=0.2), steps=90, checkpoint_dir=ck, progress=False)
except mpitrain.UsageError as e:
    print("REFUSED", "another model or run" in str(e) and "'smoothing': 0.1" in str(e))
e = mpitrain.evaluate(ck, model=SmoothedLogistic(64, 10))
print("EVAL", e["global_step"], e["test_accuracy"] == b["test_accuracy"])
class Half:
    sizes, n_params = (64, 10), 650
try:
    mpitrain.train(model=Half())
except mpitrain.UsageError as e:
    print("INCOMPLETE", e)
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "RESUMED True 60 smoothed-logistic" in out and "REFUSED True" in out and "EVAL 60 True" in out, out
    assert "INCOMPLETE model takes 'softmax', 'mlp' or an object with model.Model's members; Half lacks " \
           "description, spec, init_params, loss_and_grad, evaluate, with_backend" in out, out
    cli = run_python(f"-m mpitrain evaluate {tmp_path / 'ck'}")
    assert cli.returncode == 2 and len(own_lines(cli.stderr)) == 1, cli.stderr
    assert "holds a model of your own (smoothed-logistic); evaluate it from Python" in cli.stderr


# -- the servers' backend (--ps-device) --------------------------------------------------------------

@only_on("mpich", NUMBERS_ONLY)
@pytest.mark.parametrize("compress", ["none", "bf16"])
def test_an_async_server_computes_through_its_backend(tmp_path, compress):
    """The server's arrays come from its backend: with MPITRAIN_TEST_BACKEND=server a NumPy backend
    that shares no memory with the message buffers (as a GPU's does not) trains to the very same
    parameters as the default one. One worker and --no-overlap: the run is deterministic."""
    import json

    from conftest import child_env, run_mpitrain

    digests = []
    for test_backend in ("", "server"):
        env = {**child_env(), "MPITRAIN_TEST_BACKEND": test_backend}
        summary = tmp_path / f"s-{test_backend}.json"
        proc = run_mpitrain(2, "--no-overlap", "--steps", "150", "--compress", compress, "--ema-decay", "0.9",
                            "--eval-every", "50", "--optimizer", "adam", "--no-progress", "--summary-json",
                            str(summary), env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert ("copying as a GPU backend" in proc.stdout) == bool(test_backend)
        s = json.loads(summary.read_text())
        digests.append((s["param_digest"], s["test_accuracy"], [e["test_accuracy"] for e in s["eval_history"]]))
    assert digests[0] == digests[1]


@pytest.mark.parametrize("flags,needle", [
    (["--ps-device", "gpu", "--mode", "sync"], "--ps-device gpu applies to --mode async"),
    (["--ps-device", "gpu"], "--ps-device gpu but no GPU is usable here"),
])
def test_ps_device_gpu_is_refused_in_one_line_where_it_cannot_work(flags, needle):
    from conftest import run_mpitrain

    from mpitrain.core.backend import _import_cupy

    if "--mode" not in flags and _import_cupy()[1] > 0:
        pytest.skip("a GPU is usable here")
    proc = run_mpitrain(3, *flags, "--steps", "5")
    assert proc.returncode == 2 and len(own_lines(proc.stderr)) == 1 and needle in proc.stderr, proc.stderr


# -- the GPU backend's copy stream -------------------------------------------------------------------

class _FakeCuda:
    """Just enough of CuPy for CupyBackend's staging: streams, events and arrays log what is queued."""

    def __init__(self):
        self.log: list[tuple] = []
        cuda = self

        class Stream:
            def __init__(self, non_blocking=False, name="copy"):
                self.name = name

            def wait_event(self, ev):
                cuda.log.append(("wait", self.name, ev.on))

            def synchronize(self):
                cuda.log.append(("sync", self.name))

        class Event:
            on = None

            def record(self, stream):
                self.on = stream.name
                cuda.log.append(("record", stream.name))

        class Array:
            dtype = np.dtype(np.float32)

            def set(self, host, stream):
                cuda.log.append(("copy into", stream.name))

            def get(self, stream, out):
                cuda.log.append(("copy out of", stream.name))

        self.Stream, self.Event, self.Array = Stream, Event, Array
        self.compute = Stream(name="compute")
        self.Device = lambda i: type("D", (), {"use": lambda self: None})()
        self.runtime = type("R", (), {"getDeviceProperties": staticmethod(lambda i: {"name": b"fake"})})

    def get_current_stream(self):
        return self.compute


def test_a_gpu_copy_is_queued_behind_the_compute_that_uses_its_buffer():
    """CupyBackend's copies run on their own stream. An upload overwrites a device buffer that kernels
    queued before it may still read (a --quorum follower applying two updates in a row: the second
    overwrote the first under its optimizer step, and replicas drifted apart on an H200), so the copy
    waits for them, and what follows waits for the copy; a download waits for the kernels that
    wrote its buffer and for its own copy (MPI reads the host buffer next)."""
    from types import SimpleNamespace

    from mpitrain.core.backend import CupyBackend

    fake = _FakeCuda()
    be = CupyBackend(SimpleNamespace(cuda=fake), 0)
    host = np.zeros(4, np.float32)
    fake.log.clear()
    be.upload(fake.Array(), host)
    assert fake.log == [("record", "compute"), ("wait", "copy", "compute"), ("copy into", "copy"),
                        ("record", "copy"), ("wait", "compute", "copy")]
    fake.log.clear()
    be.download(fake.Array(), host)
    assert fake.log == [("record", "compute"), ("wait", "copy", "compute"), ("copy out of", "copy"), ("sync", "copy")]


class _DeviceArray(np.ndarray):
    """A NumPy array that must be read back with .get(), as a CuPy one."""

    def get(self):
        return np.asarray(self)


def test_a_large_gpu_model_reads_its_loss_and_finite_check_in_one_copy(monkeypatch):
    """GradientSource on a GPU backend (a stand-in module that is not NumPy): from ONE_READ_FROM parameters the
    loss and the gradient's squared norm come back in one stacked copy, with the same loss, the same gradient
    and the same verdict on a non-finite one as the two-read path."""
    import copy
    import dataclasses
    from types import SimpleNamespace

    from mpitrain.modes.gradients import GradientSource

    ctx = sync_worker_context()
    gpu_like = SimpleNamespace(dot=np.dot, stack=lambda values: np.stack(values).view(_DeviceArray))
    two = GradientSource(ctx, dealt_batches(ctx))
    assert not two.one_read  # NumPy: as before
    monkeypatch.setattr(GradientSource, "ONE_READ_FROM", 0)
    backend = copy.copy(ctx.backend)
    backend.xp = gpu_like
    one = GradientSource(dataclasses.replace(ctx, backend=backend), dealt_batches(ctx))
    assert one.one_read
    params = ctx.model.init_params(0)
    g1, g2 = np.empty_like(params), np.empty_like(params)
    assert one.compute(params, g1) == pytest.approx(two.compute(params, g2), rel=1e-6)
    np.testing.assert_array_equal(g1, g2)
    model, real = ctx.model, ctx.model.log_likelihood_and_grad

    def finite_loss_infinite_gradient(params, x, y, grad):
        total = real(params, x, y, grad)
        grad[-1] = np.inf
        return total

    monkeypatch.setattr(model, "log_likelihood_and_grad", finite_loss_infinite_gradient)
    assert np.isnan(one.compute(params, g1)) and np.isnan(two.compute(params, g2))


class AsIfTheOtherVoted(AsIfAnotherWorkerSentZeros):
    """A second worker whose part carries a vote in `slot` (it heard rank 0 make room, or a stop)."""

    def __init__(self, slot: str):
        super().__init__()
        self.slot = slot

    def sum(self, buf, part=None) -> bool:
        from mpitrain.modes import sync_step as sync

        super().sum(buf)
        buf[len(buf) - sync.SYNC_SLOTS + getattr(sync, self.slot)] += 1.0
        return True


@pytest.mark.parametrize("slot", ["VOTE", "ROOM_VOTE"])
def test_a_sync_worker_ends_the_phase_on_a_peer_s_vote_and_knows_whether_it_is_a_stop(slot):
    """Every worker ends the phase after the same step whether a peer heard of a stop or of room made for a new
    member (they hear rank 0 at different times), and each knows which: room is not a stop (the regroup clears
    it), and a stop stays a stop. One vote slot for both had made every worker's room a stop of unknown signal."""
    import dataclasses

    from mpitrain.core.stop import StopRequest
    from mpitrain.modes.gradients import GradientSource
    from mpitrain.modes.sync_outer import step_for

    ctx = dataclasses.replace(sync_worker_context(), stop=StopRequest())
    step = step_for(ctx, ctx.model.init_params(0), reducer=AsIfTheOtherVoted(slot))
    step.compute(GradientSource(ctx, dealt_batches(ctx)))
    assert not ctx.stop.due
    step.reduce_and_apply(0)
    assert step.stop and ctx.stop.due
    assert (ctx.stop.requested, ctx.stop.room) == ((True, False) if slot == "VOTE" else (False, True))


class AsIfRank0SpokeDuringTheSum(AsIfAnotherWorkerSentZeros):
    """Rank 0's word that it makes room arrives (a heartbeat) while the sum is under way: after this worker voted."""

    def __init__(self, stop):
        super().__init__()
        self.stop = stop

    def sum(self, buf, part=None) -> bool:
        self.stop.make_room()
        return super().sum(buf)


def test_a_word_heard_during_the_sum_is_the_next_step_s_vote_not_this_one_s():
    """The others summed no vote for this step, so they go on: a worker ending the phase on what it heard during
    the Allreduce would wait for rank 0 a step before them, and they for it in the next sum (a join hung so)."""
    import dataclasses

    from mpitrain.core.stop import StopRequest
    from mpitrain.modes.gradients import GradientSource
    from mpitrain.modes.sync_slots import ROOM_VOTE
    from mpitrain.modes.sync_outer import step_for

    ctx = dataclasses.replace(sync_worker_context(), stop=StopRequest())
    step = step_for(ctx, ctx.model.init_params(0), reducer=AsIfRank0SpokeDuringTheSum(ctx.stop))
    source = GradientSource(ctx, dealt_batches(ctx))
    step.compute(source)
    step.reduce_and_apply(0)
    assert not step.stop and ctx.stop.room
    step.compute(source)  # the next step votes it
    assert step.buf[step.n + ROOM_VOTE] == 1.0


class InFlightAsIfAnotherWorkerSentZeros(AsIfAnotherWorkerSentZeros):
    """The same other worker, summed through start / progress / finish (SyncStep's --outer-overlap)."""

    def __init__(self):
        super().__init__()
        self.started, self.looks, self.landed = [], 0, []

    def start(self, buf, part=None):
        self.started.append(buf.copy())
        return types.SimpleNamespace(buf=buf)

    def progress(self, flight) -> None:
        self.looks += 1

    def finish(self, flight) -> None:
        self.landed.append(self.looks)
        self.sum(flight.buf)


@only_on("mpich", NUMBERS_ONLY)
def test_an_overlapped_outer_step_lands_t_steps_later_with_the_workers_own_steps_kept_on_top():
    """--local-steps 4 --outer-overlap 2: the outer gradient of step 4 is sent, the worker takes steps 5 and 6
    meanwhile (giving the exchange a turn after each), and at step 6 the outer step lands: the global model
    moves by it, and the worker's model is that plus its own two steps since sending."""
    from mpitrain.modes.gradients import GradientSource
    from mpitrain.modes.sync_slots import STAMP
    from mpitrain.modes.sync_outer import step_for

    ctx = sync_worker_context("--local-steps", "4", "--outer-overlap", "2", "--outer-optimizer", "sgd",
                              "--outer-lr", "1", "--optimizer", "sgd")
    n, reducer = ctx.model.n_params, InFlightAsIfAnotherWorkerSentZeros()
    step = step_for(ctx, ctx.model.init_params(0), reducer=reducer)
    source = GradientSource(ctx, dealt_batches(ctx))
    start, synced, grads = step.params.copy(), [], {}
    for s in range(6):
        step.compute(source)
        grads[s] = step.buf[:n].copy()
        step.reduce_and_apply(s)
        synced.append(step.synced)
        if s == 3:  # update 3 makes global step 4: its outer gradient anchor - local is sent
            sent, at_send = reducer.started[0][:n], step.params.copy()
            np.testing.assert_array_equal(sent, start - at_send)
            # its exact slots were written before MPI was given the buffer, not after (then the sum was torn)
            assert reducer.started[0][n + STAMP] == step.overlap.stamp > 0
    assert synced == [False] * 5 + [True] and reducer.landed == [2]  # two looks at it before it landed
    # sgd at lr 1 with the other's zeros: the global model moves half the way this worker had moved ...
    np.testing.assert_allclose(step.local.anchor, start - sent / 2, rtol=1e-5, atol=1e-6)
    # ... and the worker's model is it plus the two plain sgd steps it took since sending
    own = sum(np.float32(ctx.lr_at(s)) * grads[s] for s in (4, 5))
    np.testing.assert_allclose(step.params, step.local.anchor - own, rtol=1e-5, atol=1e-6)
    assert step.overlap.sent_at == 4 and step.overlap.flight is None


class RecordingSizes(AsIfAnotherWorkerSentZeros):
    """The same other worker, recording how many values each sum carried."""

    def __init__(self):
        super().__init__()
        self.sizes, self.parts = [], []

    def sum(self, buf, part=None) -> bool:
        self.sizes.append(len(buf))
        self.parts.append(part)
        return super().sum(buf)


@only_on("mpich", NUMBERS_ONLY)
def test_fragments_average_one_part_of_the_parameters_in_turn_each_every_h_steps():
    """--local-steps 4 --fragments 2: an outer step every 2 steps, of half the parameters in turn (the second
    half at step 2, the first at step 4, ...), each exchange carrying that half and the exact slots; the
    other half stays this worker's own. With sgd at lr 1 and a worker of zeros, a part's global model moves
    half the way this worker had moved it."""
    from mpitrain.modes.gradients import GradientSource
    from mpitrain.modes.sync_slots import SYNC_SLOTS
    from mpitrain.modes.sync_outer import step_for

    ctx = sync_worker_context("--local-steps", "4", "--fragments", "2", "--outer-optimizer", "sgd",
                              "--outer-lr", "1", "--optimizer", "sgd")
    n, reducer = ctx.model.n_params, RecordingSizes()
    step = step_for(ctx, ctx.model.init_params(0), reducer=reducer)
    source = GradientSource(ctx, dealt_batches(ctx))
    half = n // 2
    first, second = slice(0, half), slice(half, n)
    start, own = step.params.copy(), np.zeros(n, np.float32)
    for s in range(2):
        step.compute(source)
        own += np.float32(ctx.lr_at(s)) * step.buf[:n]
        step.reduce_and_apply(s)
    assert reducer.sizes == [n - half + SYNC_SLOTS]  # global step 2: the second half alone
    np.testing.assert_allclose(step.local.anchor[second], (start - own / 2)[second], rtol=1e-5, atol=1e-6)
    moved = start - step.params  # (before the outer step: the second half was reset to the anchor)
    np.testing.assert_array_equal(step.local.anchor[first], start[first])  # the first half not averaged yet
    np.testing.assert_array_equal(step.params[second], step.local.anchor[second])
    assert np.abs(moved[first]).sum() > 0  # ... and this worker's own steps there are kept
    for s in range(2, 4):
        step.compute(source)
        step.reduce_and_apply(s)
    assert reducer.sizes == [n - half + SYNC_SLOTS, half + SYNC_SLOTS]  # global step 4: the first half
    assert reducer.parts == [second, first]  # each sum says which (a compressed one keeps each part's feedback)
    np.testing.assert_array_equal(step.params[first], step.local.anchor[first])
    assert not np.array_equal(step.params[second], step.local.anchor[second])  # its 2 steps since


def test_a_fragment_s_compressed_exchange_keeps_its_error_feedback_in_the_whole_model_s():
    """--fragments with --compress int8: each part has a compressor whose residual is a view of the whole's, so
    an exchange of one part holds back its own and leaves the other part's alone; the checkpoint's row (the
    whole's residual) holds every part's, and an exchange of all of them (the run's last) sends them all."""
    from mpitrain.exchange.compressed import GatherReducer
    from mpitrain.modes.sync_slots import SYNC_SLOTS

    ctx = sync_worker_context("--local-steps", "4", "--fragments", "2", "--compress", "int8")
    n = ctx.model.n_params
    reducer = GatherReducer(ctx, n, SYNC_SLOTS)
    first, second = slice(0, n // 2), slice(n // 2, n)
    part = reducer._for(second)
    assert part is reducer._for(second) and reducer._for(None) is reducer._for(slice(0, n)) is reducer.compressor
    assert np.shares_memory(part.residual, reducer.compressor.residual)
    values = np.random.default_rng(0).normal(size=n - n // 2).astype(np.float32)
    wire = np.empty(part.wire_bytes, np.uint8)
    part.compress(values, wire)
    held = reducer.compressor.residual
    assert np.abs(held[second]).max() > 0 and not held[first].any()  # int8 held some back, of that part alone
    sent = np.empty_like(values)
    part.decompress(wire, sent)
    np.testing.assert_allclose(sent + held[second], values, rtol=0, atol=1e-6)  # sent + held back = what was owed
