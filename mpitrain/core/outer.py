"""--local-steps H: local SGD (Lin et al. 2020) and DiLoCo (Douillard et al. 2023). Each worker
takes H steps of --optimizer on its own batches (its optimizer state stays its own); then the
workers average how far they moved, the outer gradient anchor - local (one Allreduce every H steps,
instead of every step), and every worker applies the same outer step to the anchor, the global
model they all started the H steps from. Outer sgd with lr 1 is plain model averaging; DiLoCo's
is Nesterov momentum (lr 0.7, momentum 0.9). Replicas are identical after each outer step, so a
checkpoint is taken there (the anchor, and the outer momentum as the optimizer state OUTER_STATE).

In async, each worker pushes its own outer gradient after its H steps (AsyncWorker), and each
server applies it as one outer step to the global model with OuterUpdate, its update rule, and
answers with the new global model: no worker waits for another. Its default outer optimizer is
delayed-nesterov, whose momentum moves once every W pushes (OuterOptimizer). With --quorum Q, each worker's H
steps are one round (RoundSource), and an outer step averages the first Q rounds computed from the
current global model."""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from mpitrain.core.optim import Optimizer, make_ema, staleness_scaled_lr

OUTER_STATE = "outer_v"  # the outer Nesterov momentum, as checkpoints and the start-up broadcast name it
OUTER_BUFFER = "outer_buf"  # delayed-nesterov: the sum of the pushes since its last momentum step
# Each --outer-optimizer's state arrays (checkpoint.state_arrays sends and saves them).
OUTER_STATES = {"sgd": (), "nesterov": (OUTER_STATE,), "delayed-nesterov": (OUTER_STATE, OUTER_BUFFER)}


class OuterOptimizer:
    """sgd: anchor -= lr * delta; nesterov (Sutskever et al. 2013, as torch.optim.SGD(nesterov=True)):
    v = mu * v + delta, anchor -= lr * (delta + mu * v).

    delayed-nesterov (async only; Liu et al. 2024, "Asynchronous Local-SGD Training for Language
    Modeling", arXiv 2401.09135, with its c = 0): Nesterov whose momentum moves once every N pushes (N:
    the workers), on their mean. Each push moves the anchor by lr / N * delta on its own; every N-th
    push also sets v = mu * v + (sum of the last N) / N and moves it by lr * mu * v. A round of N pushes
    then moves it as nesterov moves it for their mean, where momentum taken at every push compounds N
    pushes a round (async nesterov learned nothing: config.DEFAULT_OUTER_OPTIMIZER)."""

    def __init__(self, kind: str, lr: float, momentum: float, n: int, xp=np, saved: dict | None = None,
                 period: int = 1):
        self.lr, self.mu, self.xp = lr, momentum, xp
        names = OUTER_STATES[kind]
        self.v = xp.zeros(n, xp.float32) if OUTER_STATE in names else None
        self.buf = xp.zeros(n, xp.float32) if OUTER_BUFFER in names else None
        for name, array in self.state().items():
            if saved is not None and name in saved:
                array[...] = xp.asarray(saved[name])
        self.period = max(1, period)
        self.tmp = xp.empty(n, xp.float32)

    def step(self, anchor, delta, lr: float | None = None, t: int = 0, part: slice = slice(None)) -> None:
        """One outer step of `anchor` along `delta`, at `lr` (default: the outer learning rate); `t`:
        the outer steps before it (delayed-nesterov's count of pushes); `part`: of the parameters only (--fragments:
        `delta` is that part's, the momentum's part moves)."""
        xp, f32, tmp = self.xp, self.xp.float32, self.tmp[part]
        lr = self.lr if lr is None else lr
        if self.buf is not None:
            self._delayed(anchor, delta, lr, t)
            return
        if self.v is None:
            xp.multiply(delta, f32(lr), out=tmp)
        else:
            v = self.v[part]
            v *= f32(self.mu)
            v += delta
            xp.multiply(v, f32(self.mu), out=tmp)
            tmp += delta
            tmp *= f32(lr)
        anchor[part] -= tmp

    def _delayed(self, anchor, delta, lr: float, t: int) -> None:
        xp, f32, tmp, n = self.xp, self.xp.float32, self.tmp, self.period
        self.buf += delta
        xp.multiply(delta, f32(lr / n), out=tmp)
        anchor -= tmp
        if (t + 1) % n == 0:
            self.v *= f32(self.mu)
            self.buf *= f32(1.0 / n)
            self.v += self.buf
            self.buf[...] = 0
            xp.multiply(self.v, f32(lr * self.mu), out=tmp)
            anchor -= tmp

    def state(self) -> dict:
        return {name: a for name, a in ((OUTER_STATE, self.v), (OUTER_BUFFER, self.buf)) if a is not None}

    def adopt(self, arrays: dict) -> None:
        """Keep the state in `arrays` from now on (views of the node-shared store's, exchange/shm.py)."""
        self.v = arrays.get(OUTER_STATE, self.v)
        self.buf = arrays.get(OUTER_BUFFER, self.buf)


class OuterUpdate:
    """The async server's update rule with --local-steps H (optim.ServerUpdate's interface): a pushed
    outer gradient (the worker's anchor - local after its H steps) is one outer step of the server's
    parameters, then the moving average. Its state is the outer optimizer's (`state`: the momentum
    OUTER_STATE, and delayed-nesterov's OUTER_BUFFER, whose count is `t`, the outer steps applied);
    the inner optimizers' stay on the workers. delayed-nesterov's W is the workers of the phase's start.

    With --staleness-lr K the outer learning rate is damped as a gradient's is: times K / staleness
    once the global model has moved more than K global steps since the push's anchor (the same K
    means the same thing at every H), but never below 1 / W of it with W workers pushing, where a
    round of W pushes moves the model as far as model averaging does. Counted in outer steps instead
    (as before 2026-11-27) the pushes of 3 workers at H 8 are 2 outer but 16 global steps stale and
    went undamped: erratic (digits, 1 core: 0.889-0.961; MNIST-sized, 8 workers: 0.63-0.73), where
    this rule gives 0.947-0.955 and 0.9385-0.942 (benchmarks/LOCAL_STEPS.md)."""

    def __init__(self, cfg, params, xp, start_step: int, opt_t: int, opt_state: dict, saved_ema=None,
                 workers: int = 0, version: int = 0):
        self.params, self.tolerance, self.t = params, cfg.staleness_tolerance, opt_t
        self.outer = OuterOptimizer(cfg.outer_rule, cfg.outer_learning_rate, cfg.outer_beta,
                                    params.shape[0], xp, opt_state, period=workers)
        self.opt = self  # what the server saves: `t` and `state`, as an Optimizer's
        self.ema = make_ema(cfg.ema_decay, params, xp, start_step, saved_ema)
        self.dc = None
        self.pushing = set(range(workers))  # the workers whose pushes are still to come (the floor's W)

    @property
    def state(self) -> dict:
        return self.outer.state()

    @state.setter
    def state(self, arrays: dict) -> None:  # as an Optimizer's: exchange/shm_push.SharedUpdate keeps it in the store
        self.outer.adopt(arrays)

    def was_sent(self, worker: int, version: int) -> None:
        pass

    def forget(self, worker: int) -> None:
        """`worker` pushes no more (stopped or lost): the floor is 1 / the workers still pushing."""
        self.pushing.discard(worker)

    def apply(self, delta, lr: float, staleness: int, worker: int = 0, basis: int = 0) -> None:
        """`lr` is the inner one (unused: an outer step has its own); `staleness` in global steps."""
        outer_lr = self.outer.lr
        if self.tolerance:
            averaging = outer_lr / max(1, len(self.pushing | {worker}))
            outer_lr = max(staleness_scaled_lr(outer_lr, staleness, self.tolerance), averaging)
        self.outer.step(self.params, delta, outer_lr, self.t)
        self.t += 1
        if self.ema:
            self.ema.update(self.params)


class PushSpans:
    """A server's (or the store's) count of the global steps each worker's push makes: one, or with
    --local-steps H the inner steps since that worker's last push (its count of inner steps, which each
    push carries, says: H, or fewer at its data's end)."""

    def __init__(self, h: int, workers: int):
        self.h, self.counted = h, [0] * workers

    def span(self, w: int, count: int) -> int:
        if self.h == 1:
            return 1
        inner, self.counted[w] = count - self.counted[w], count
        return inner


def in_pushes(staleness: int, h: int) -> int:
    """A push's staleness in global steps as the summary and --max-staleness count it with --local-steps
    H: in outer steps, about H global steps each (rounded up)."""
    return -(-staleness // h)


class InnerSteps:
    """An async worker's H steps between two pushes: --optimizer on its own copy of the parameters
    (the optimizer's state is the worker's own, never sent), then the outer gradient start - local
    (how far it moved from the global model it pulled) into the push's buffer.

    With `own` (async --overlap; eager local SGD, as Streaming DiLoCo's overlap and arXiv 2502.12996) a
    worker does not wait for the reply to its push: its next H steps go on from its own model, and their
    outer gradient is how far they moved it. When the reply lands, the worker's model becomes the global
    model it brings plus the steps not in it yet (`rebase`): those of the run computed since the push,
    which its next push carries. Each outer step then reaches a worker one push later."""

    def __init__(self, cfg, n: int, xp=np, own: bool = False):
        self.h, self.xp, self.own = cfg.local_steps, xp, own
        self.opt = Optimizer(cfg.optimizer, n, xp, momentum=cfg.momentum)
        self.local, self.grad = xp.empty(n, xp.float32), xp.empty(n, xp.float32)
        self.count = 0  # inner steps taken in this run: each push carries it (protocol.H_PUSHED)
        self.begun = False  # whether `local` holds a model yet (with `own`, each run goes on from it)

    def run(self, anchor, out, compute: Callable, exhausted: Callable[[], bool], lr_at: Callable[[int], float],
            version: int, steps: int | None = None) -> float:
        """Up to H steps (or `steps`: a --quorum round cut short by the budget) from `anchor` (of
        global step `version`), fewer when the worker's data runs out or a loss is not finite (the
        push then carries it: the server stops the run); `out` gets start - local, where start is
        `anchor` (with `own`: the worker's model, `anchor` at the first run). Returns the mean loss of the steps."""
        if not (self.own and self.begun):
            self.local[...] = anchor
        self.begun = True
        out[...] = self.local  # the start (anchor - local, as before, where it is the anchor: the same float32 bits)
        losses: list[float] = []
        for i in range(self.h if steps is None else steps):
            loss = compute(self.local, self.grad)
            losses.append(loss)
            if not math.isfinite(loss):
                break
            self.opt.step(self.local, self.grad, lr_at(version + i))
            if exhausted():
                break
        out -= self.local
        self.count += len(losses)
        return float(np.mean(losses))

    def rebase(self, params, unsent=None) -> None:
        """`own`: a reply landed with the global model `params`; this worker's model becomes it, less `unsent`
        (the outer gradient start - local of a run computed since the push it answers, not pushed yet)."""
        self.local[...] = params
        if unsent is not None:
            self.local -= unsent


class OneStep:
    """An async worker's step between two pushes without --local-steps (InnerSteps' interface): one gradient,
    computed on the parameters it pulled straight into the push's buffer; its count is the pushes'."""

    own = False  # nothing of its own goes on while a push travels: each step starts from the parameters pulled

    def __init__(self):
        self.count = 0

    def run(self, anchor, out, compute: Callable, exhausted: Callable[[], bool], lr_at: Callable[[int], float],
            version: int, steps: int | None = None) -> float:
        self.count += 1
        return compute(anchor, out)

    def rebase(self, params, unsent=None) -> None:
        pass


def steps_for(cfg, n: int, xp=np, own: bool = False) -> InnerSteps | OneStep:
    """An async worker's steps between two pushes: --local-steps H's (InnerSteps), or one gradient (OneStep)."""
    return InnerSteps(cfg, n, xp, own=own) if cfg.local_steps > 1 else OneStep()


class LocalSteps:
    """A sync worker's schedule with --local-steps H: which steps end with an outer step, the anchor,
    the outer optimizer, and the inner losses behind the next outer step's mean loss."""

    def __init__(self, cfg, params, xp, saved_outer: dict | None = None):
        self.h = cfg.local_steps
        # --fragments F: the parameters in F contiguous parts, part f's outer step every H steps from step f x H/F
        self.span, n = self.h // cfg.fragments, params.shape[0]
        cuts = [n * f // cfg.fragments for f in range(cfg.fragments + 1)]
        self.parts = [slice(a, b) for a, b in zip(cuts, cuts[1:])]
        self.anchor = params.copy()
        self.outer = OuterOptimizer(cfg.outer_rule, cfg.outer_learning_rate, cfg.outer_beta,
                                    params.shape[0], xp, saved_outer)
        self.losses: list[float] = []

    def due(self, step: int, last: bool) -> bool:
        """Whether update `step` (making global step step + 1) ends with an outer step: every H
        global steps (H/F with --fragments F: one part's), and at the budget's end, so that a run always ends on
        the global model."""
        return (step + 1) % self.span == 0 or last

    @staticmethod
    def words(fragments: int) -> str:
        """--fragments F, for the start line."""
        if fragments == 1:
            return ""
        return (f"; in {fragments} fragments (--fragments {fragments}): each outer step averages the next "
                f"1/{fragments} of the parameters in turn, each fragment every H steps")

    def part(self, step: int, last: bool) -> slice:
        """The parameters the outer step after update `step` averages: every H/F steps the next part in turn,
        all of them at the budget's end."""
        return slice(0, self.anchor.shape[0]) if last else self.parts[(step + 1) // self.span % len(self.parts)]


def falls_due(every: int, step: int, span: int = 1) -> bool:
    """Whether one of the `span` global steps ending at `step` is a multiple of `every` (0: never): a duty due at
    any step an update made (--eval-every, --checkpoint-every-steps), with no step looked at one by one."""
    return bool(every) and step // every > (step - span) // every


class Overlap:
    """--outer-overlap T (sync; Streaming DiLoCo's overlap, Douillard et al. 2025, arXiv 2501.18512): the outer
    exchange sent at an outer step lands T inner steps later, the worker computing on meanwhile from its own
    model. Landed, the outer step moves the global model (the anchor) exactly as it would have at once, and
    the worker's own steps since are kept on top of it: local = anchor + (local - sent). Streaming DiLoCo
    mixes the two instead (its alpha); kept whole, T 0 is the outer step without overlap bit for bit, and
    the next outer gradient (anchor - local) carries those T steps to the others."""

    def __init__(self, t: int, params, xp=np):
        self.t, self.xp = t, xp
        self.sent = xp.empty_like(params)  # this worker's model when its outer gradient was sent
        self.flight = None  # the exchange in flight (exchange/mpi.InFlight), its step stamp, where it lands
        self.stamp = self.lands_at = 0
        self.buf, self.part = None, slice(None)  # the step's buffer it was sent from, and its part (--fragments)
        self.sent_at = 0  # the global step of the outer step in flight (or last landed): what the anchor holds
        self.moved = False  # whether an inner step moved this worker's model since it was sent

    @staticmethod
    def words(t: int | None) -> str:
        """--outer-overlap T, for the start line."""
        if t is None:
            return ""
        if t == 0:
            return "; its outer step lands at once (--outer-overlap 0)"
        return f"; its outer step lands {t} inner steps later (--outer-overlap {t}), each worker computing on meanwhile"

    def launch(self, flight, stamp: int, params, step: int, last: bool, buf, part: slice = slice(None)) -> None:
        """The outer gradient of update `step` sent (`flight`, from the step's buffer `buf`; of `part` of the
        parameters with --fragments): it lands T steps on, at once if `last`."""
        self.flight, self.stamp, self.moved, self.buf, self.part = flight, stamp, False, buf, part
        self.sent[part] = params[part]
        self.sent_at = step + 1
        self.lands_at = step + 1 + (0 if last else self.t)

    def rebase(self, params, anchor) -> None:
        """The outer step landed in `anchor` (its part): `params` becomes it plus this worker's steps since sending."""
        part = self.part
        if not self.moved:
            params[part] = anchor[part]
            return
        sent = self.sent[part]
        self.xp.subtract(anchor[part], sent, out=sent)
        params[part] += sent


def round_span(step: int, total: int, h: int) -> int:
    """The global steps a round from global step `step` covers: H, fewer at the budget's end."""
    return max(1, min(h, total - step))


class RoundSource:
    """--quorum with --local-steps H: a worker's contribution to an outer step is H inner steps from
    the global model (InnerSteps: as in async, the inner optimizer's state is the worker's own and a
    checkpoint does not hold it), not one gradient. It stands where quorum.py's loops use a GradientSource:
    `compute(params, out, step)` writes the outer gradient anchor - local into `out` and returns the
    round's mean inner loss; `seconds` is how long the H steps took (the quorum's pace)."""

    def __init__(self, source, inner: InnerSteps, lr_at: Callable[[int], float], total: Callable[[], int]):
        self.source, self.inner, self.lr_at, self.total = source, inner, lr_at, total
        self.seconds = 0.0

    def compute(self, params, out, step: int) -> float:
        t0 = time.perf_counter()
        span = round_span(step, self.total(), self.inner.h)
        loss = self.inner.run(params, out, self.source.compute, lambda: False, self.lr_at, step, span)
        self.seconds = time.perf_counter() - t0
        return loss
