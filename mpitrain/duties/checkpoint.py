"""Checkpoints: one .npz per save (no pickle), written atomically, validated on load.

A checkpoint holds everything needed to continue: the flat parameters, the optimizer state, the
global step, each worker's position in its data stream (sync: the deal's,
core/ledger.py), and a fingerprint of the model (layer
sizes, optimizer) that a resumed run must match. The data order needs no RNG state: every
epoch's shuffle is a pure function of (--seed, epoch), so the position alone restores it.
Saving writes a temporary file in the same folder, fsyncs it, then os.replace()s it into place:
a job killed at any moment leaves every finished checkpoint intact and loadable.
"""

from __future__ import annotations

import errno
import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpitrain.core import atomic
from mpitrain.core.atomic import write_atomic
from mpitrain.core.config import UsageError
from mpitrain.core.model import builtin_spec
from mpitrain.core.optim import REGISTRY as OPTIMIZER_REGISTRY
from mpitrain.core.outer import OUTER_STATES, falls_due
from mpitrain.duties.outputs import WRITES

NAME = re.compile(r"^ckpt-(\d{9})\.npz$")
FORMAT = 1


@dataclass
class TrainState:
    """What a run starts from (fresh or resumed) and what a checkpoint stores."""

    params: np.ndarray
    global_step: int = 0
    opt_t: int = 0
    opt_state: dict[str, np.ndarray] = field(default_factory=dict)  # the optimizer's arrays by name (optim.REGISTRY)
    positions: list[int] = field(default_factory=list)  # batches each worker has taken
    ema: np.ndarray | None = None  # --ema-decay: moving average of the parameters
    # A take-over's offer (failover.py): each shard's version of the slice held here (-1: none held);
    # None: every slice, at global_step (a sync replica)
    versions: list[int] | None = None
    # The deal (core/ledger.py): sync, the job's batches in the updates applied; async, the next batch number never
    # dealt. The workers every epoch is cut for; async's blocks (first, count) dealt and not applied, to deal again.
    # None, 0 and none in a state from before the ledger (an older checkpoint). An async worker's offer at a
    # take-over: the furthest number lent to it, and its blocks not known applied (failover.lent_ledger).
    # --quorum: the batches dealt that the updates left out (a worker not in the Q), by epoch
    dealt: int | None = None
    deal_shards: int = 0
    redeal: list = field(default_factory=list)
    in_flight: list = field(default_factory=list)  # an async worker's offer: the block pushed, not answered yet,
    answered: list = field(default_factory=list)  # ... and its last blocks answered (applied)
    mark: tuple[int, int] | None = None  # ... and what rank 0's answer said of its parameters (ledger.mark)
    left_out: dict[int, int] = field(default_factory=dict)
    # Async: the batches a take-over of rank 0 dealt again that its copy had applied, by epoch (ledger.epochs)
    repeated: dict[int, int] = field(default_factory=dict)
    # Async with --num-ps: batches whose gradient some servers' slices hold and others' not (a worker lost between
    # its pushes, a push rank 0 stopped the run before applying), by epoch (AsyncServer._partial)
    partial: dict[int, int] = field(default_factory=dict)
    # Sync: what each worker holds for itself at global_step (Mode.worker_arrays), a row per worker in worker
    # order, by name: its error-feedback residual (RESIDUAL) and with --local-steps its inner optimizer's
    # arrays (INNER + name). Empty: none kept (other modes, a regroup's or a take-over's state).
    per_worker: dict[str, np.ndarray] = field(default_factory=dict)

    def deal_words(self) -> list[int]:
        """`dealt` and `deal_shards` as the two int64 words a broadcast carries (-1: no count)."""
        return [-1 if self.dealt is None else self.dealt, self.deal_shards]

    def take_deal_words(self, words) -> None:
        self.dealt, self.deal_shards = (None if words[0] < 0 else int(words[0])), int(words[1])

    def position(self, worker: int) -> int:
        return self.positions[worker] if worker < len(self.positions) else 0

    def array(self, name: str) -> np.ndarray | None:
        """A flat array by its name in a checkpoint file: params, ema, or opt_<state name>."""
        if name.startswith(OPT_PREFIX):
            return self.opt_state.get(name[len(OPT_PREFIX):])
        return getattr(self, name)

    def set_array(self, name: str, value: np.ndarray) -> None:
        if name.startswith(OPT_PREFIX):
            self.opt_state[name[len(OPT_PREFIX):]] = value
        else:
            setattr(self, name, value)


# An optimizer's state array NAME is stored as "opt_NAME" (opt_m, opt_v: the files of earlier
# versions load unchanged); "opt_t", its update count, is a scalar beside them.
OPT_PREFIX, OPT_COUNT = "opt_", "opt_t"
WORKER_PREFIX = "worker_"  # a TrainState.per_worker array's name in a checkpoint file
# The ledger's counts by epoch a checkpoint keeps ((epoch, batches) rows), and what a bad file's line calls them
BY_EPOCH = {"left_out": "left out of the updates", "repeated": "dealt twice", "partial": "applied in part"}
# per_worker's names: error feedback; an inner optimizer's array by its name; the worker's own model (--outer-overlap,
# --fragments: it is not the global model between outer steps); the sums' error feedback (--compress-replies)
RESIDUAL, INNER, OWN_MODEL, SUMS = "residual", "inner_", "model", "sums"


def state_arrays(cfg) -> list[str]:
    """Names of a training state's flat arrays, in the order they travel (the start-up broadcast,
    the sync coordinator -> rank 0): params, the optimizer's state, the moving average."""
    inner = OPTIMIZER_REGISTRY[cfg.optimizer].state if cfg.inner_state_saved else ()
    names = ["params"] + [OPT_PREFIX + name for name in inner]
    if cfg.local_steps > 1:  # the outer optimizer's state (outer.py)
        names += [OPT_PREFIX + name for name in OUTER_STATES[cfg.outer_rule]]
    return names + (["ema"] if cfg.ema_decay else [])


def to_flat(state: TrainState, names: list[str]) -> np.ndarray:
    return np.concatenate([state.array(name) for name in names])


def from_flat(flat: np.ndarray, names: list[str], n: int, step: int, positions: list[int]) -> TrainState:
    state = TrainState(flat[:n].copy(), step, step, positions=list(positions))
    for i, name in enumerate(names[1:], 1):
        state.set_array(name, flat[i * n : (i + 1) * n].copy())
    return state


class Checkpointer:
    """When rank 0 saves: every --checkpoint-every-steps global steps and/or every
    --checkpoint-every-secs seconds, and once at the end. Inactive without --checkpoint-dir."""

    def __init__(self, cfg, fp: dict, clock=None):
        import time

        self.cfg, self.fp = cfg, fp
        self.clock = clock or time.monotonic
        self.enabled = cfg.checkpoint_dir is not None
        self.dir = Path(cfg.checkpoint_dir) if self.enabled else None
        self.last_time = self.clock()
        self.last_step = None
        self.saved: list[str] = []

    def due(self, step: int, span: int = 1) -> bool:
        """A save is due after global step `step` (or any of the `span` steps an update ending there made)."""
        if not self.enabled:
            return False
        return (falls_due(self.cfg.checkpoint_every_steps, step, span)
                or self.clock() - self.last_time >= self.cfg.checkpoint_every_secs)

    def mark(self, step: int) -> None:
        """A save was started at `step` (by rank 0, or by the sync coordinator sending its state)."""
        self.last_time, self.last_step = self.clock(), step

    def save(self, state: TrainState, final: bool = False) -> bool:
        """Write `state` unless it was written already; False when the write failed (a full disk,
        a quota, an I/O error): that is reported, and training goes on from the next one."""
        if self.enabled and not np.isfinite(state.params).all():
            self.mark(state.global_step)  # never write a non-finite state: the last good one stays newest
            return True
        if self.enabled and state.global_step != self.last_step:
            try:
                try:
                    path = save(self.dir, state, self.fp, self.cfg.keep_checkpoints)
                except OSError as e:
                    # Out of space: the older checkpoints go first (never the newest), then once more.
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT) or not prune(self.dir, keep=1):
                        raise
                    path = save(self.dir, state, self.fp, self.cfg.keep_checkpoints)
                    WRITES.note("checkpoint space", f"{self.dir} is out of space ({e.strerror}): the checkpoints "
                                f"before the newest were deleted to make room for global step {state.global_step}",
                                f"fewer than --keep-checkpoints {self.cfg.keep_checkpoints} are kept; training goes on")
                self.saved.append(str(path))
                WRITES.newest_checkpoint = self.saved[-1]
            except OSError as e:
                newest = list_checkpoints(self.dir)
                good = f"the newest good one is {newest[-1].name}" if newest else "there is no good one yet"
                WRITES.failed("checkpoint", f"checkpoint at global step {state.global_step}", self.dir, e,
                              f"{good}; " + ("the run ends without it" if final else "training goes on"))
                if final:
                    WRITES.incomplete = True
                self.last_time = self.clock()  # not mark(): a final save of this step tries again
                return False
        self.mark(state.global_step)
        return True


# Recorded, not compared: where an npz dataset was (an absolute path), for `mpitrain evaluate` from any
# folder; a run resumed from another folder, or with the file moved, is still the same run.
WHERE_KEYS = ("dataset_path",)


def fingerprint(sizes: tuple[int, ...], optimizer: str, dataset: str = "", seed: int = 0,
                model: dict | None = None, dataset_path: str | None = None) -> dict:
    """What a resumed run must share with the checkpoint: the model (its spec, model.Model; the
    built-ins' is their kind and layer sizes) and optimizer (the state's layout), and the dataset
    and --seed (the data order it continues); and where an npz dataset was (WHERE_KEYS)."""
    spec = model if model is not None else builtin_spec(sizes)
    fp = {"format": FORMAT, "layer_sizes": list(sizes), "model": spec, "optimizer": optimizer, "dataset": dataset,
          "seed": seed}
    return fp if dataset_path is None else {**fp, "dataset_path": dataset_path}


def path_for(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:09d}.npz"


def bcast_pairs(comm, pairs, root: int) -> list[tuple[int, int]]:
    """`root`'s list of (int, int) pairs on every rank of `comm`: its length, then the pairs (int64). At a
    start, a regroup or a take-over only (the data ledger's blocks to deal again, a quorum's left-out counts)."""
    from mpi4py import MPI  # at a collective's time: MPI is initialised (node.world)

    mine = comm.Get_rank() == root
    count = np.array([len(pairs) if mine else 0], np.int64)
    comm.Bcast([count, MPI.INT64_T], root=root)
    if not count[0]:
        return []
    # (the receivers' buffer made as int64: a float one cast to it warned of the garbage it held, NaN)
    arr = (np.ascontiguousarray(np.asarray(pairs, np.int64).reshape(-1, 2)) if mine
           else np.empty((count[0], 2), np.int64))
    comm.Bcast([arr, MPI.INT64_T], root=root)
    return [(int(a), int(b)) for a, b in arr]


def split_rows(rows: np.ndarray, names: tuple[str, ...], n: int) -> dict[str, np.ndarray]:
    """TrainState.per_worker from its one matrix on the wire, a row per worker of each name's `n` values in turn."""
    return {name: rows[:, k * n:(k + 1) * n].copy() for k, name in enumerate(names)}


def bcast_per_worker(comm, per_worker: dict[str, np.ndarray], names: tuple[str, ...], width: int,
                     root: int) -> dict[str, np.ndarray]:
    """`root`'s TrainState.per_worker (rows of `width` float32 under each of `names`; none unless it holds every
    name) on every rank of `comm`: at a start (a resume), where each worker takes its rows (modes/sync_step.SyncStep)."""
    from mpi4py import MPI

    mine = comm.Get_rank() == root
    held = mine and all(name in per_worker for name in names)
    count = np.array([len(per_worker[names[0]]) if held and names else 0], np.int64)
    comm.Bcast([count, MPI.INT64_T], root=root)
    out = {}
    for name in names if count[0] else ():
        arr = np.ascontiguousarray(per_worker[name], np.float32) if mine else np.empty((count[0], width), np.float32)
        comm.Bcast([arr, MPI.FLOAT], root=root)
        out[name] = arr
    return out


def bcast_ledger(comm, mine, into, root: int) -> None:
    """`root`'s data ledger (core/ledger.py) from its state `mine` into `into`, on every rank of `comm`:
    where the deal got to and the workers it is cut for, async's blocks to deal again, and --quorum's
    batches left out of the updates by epoch. The one place a start, a regroup and a take-over send it."""
    from mpi4py import MPI

    words = np.array(mine.deal_words(), np.int64)
    comm.Bcast([words, MPI.INT64_T], root=root)
    into.take_deal_words(words)
    into.redeal = bcast_pairs(comm, mine.redeal, root)
    into.left_out = dict(bcast_pairs(comm, sorted(mine.left_out.items()), root))
    into.repeated = dict(bcast_pairs(comm, sorted(mine.repeated.items()), root))


def list_checkpoints(directory: Path) -> list[Path]:
    """Finished checkpoints, oldest first (temporary files of interrupted saves are not listed)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save(directory: Path, state: TrainState, fp: dict, keep: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {"params": state.params, "global_step": np.int64(state.global_step), OPT_COUNT: np.int64(state.opt_t),
              "positions": np.asarray(state.positions, np.int64), "fingerprint": np.array(json.dumps(fp))}
    arrays.update({OPT_PREFIX + name: a for name, a in state.opt_state.items()})
    if state.ema is not None:
        arrays["ema"] = state.ema
    if state.dealt is not None:
        arrays["dealt"], arrays["deal_shards"] = np.int64(state.dealt), np.int64(state.deal_shards)
        arrays["redeal"] = np.asarray(state.redeal, np.int64).reshape(-1, 2)
        for name in BY_EPOCH:
            arrays[name] = np.asarray(sorted(getattr(state, name).items()), np.int64).reshape(-1, 2)
    arrays.update({WORKER_PREFIX + name: rows for name, rows in state.per_worker.items()})
    target = write_atomic(path_for(directory, state.global_step), lambda f: np.savez(f, **arrays), binary=True)
    prune(directory, keep)
    return target


def prune(directory: Path, keep: int) -> bool:
    """Delete all but the newest `keep` finished checkpoints; True if any went."""
    removed = False
    for old in list_checkpoints(directory)[:-keep]:
        try:
            old.unlink()
            removed = True
        except OSError:  # a read-only remount, an I/O error: an extra old checkpoint costs nothing
            pass
    return removed


def load(path: Path, fp: dict | None = None) -> TrainState:
    """Read and validate one checkpoint; UsageError (one line) when it is unusable."""
    fix = f"delete or move {path.name}, or pass --fresh to start over (nothing was deleted)"
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}  # reads every member: a truncated file fails here
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise UsageError(f"checkpoint {path} is corrupt or truncated ({type(e).__name__}); {fix}") from None
    missing = {"params", "global_step", OPT_COUNT, "positions", "fingerprint"} - set(data)
    if missing:
        raise UsageError(f"checkpoint {path} lacks {', '.join(sorted(missing))}: not an mpitrain checkpoint; {fix}")
    saved = json.loads(str(data["fingerprint"]))
    if fp is not None:
        saved, fp = ({k: v for k, v in d.items() if k not in WHERE_KEYS} for d in (saved, fp))
    if fp is not None and "model" not in saved:  # written before models had a spec: the built-ins' sizes say it
        fp = {k: v for k, v in fp.items() if k != "model"}
    if fp is not None and saved != fp:
        keys = [k for k in fp if saved.get(k) != fp[k]]
        if "model" in keys and "layer_sizes" in keys:  # the model's spec says its sizes
            keys.remove("layer_sizes")
        differ = ", ".join(f"{k} {saved.get(k)} vs {fp[k]} here" for k in keys)
        raise UsageError(f"checkpoint {path} is of another model or run ({differ}); use the same --model/--hidden/"
                         f"--optimizer/--dataset/--seed, another --checkpoint-dir, or --fresh")
    params = data["params"]
    if params.dtype != np.float32 or not np.isfinite(params).all():
        raise UsageError(f"checkpoint {path} holds non-finite or non-float32 parameters; {fix}")
    opt_state = {k[len(OPT_PREFIX):]: a for k, a in data.items() if k.startswith(OPT_PREFIX) and k != OPT_COUNT}
    dealt = int(data["dealt"]) if "dealt" in data else None
    shards = int(data["deal_shards"]) if "deal_shards" in data else 0
    if dealt is not None and (dealt < 0 or shards < 1):
        raise UsageError(f"checkpoint {path} holds a data deal of {dealt} batches over {shards} shards; {fix}")
    redeal = data.get("redeal", np.zeros((0, 2), np.int64))
    if (redeal.dtype != np.int64 or redeal.ndim != 2 or redeal.shape[1] != 2 or (redeal[:, 0] < 0).any()
            or (redeal[:, 1] < 1).any() or (dealt is not None and (redeal.sum(axis=1) > dealt).any())):
        raise UsageError(f"checkpoint {path} holds batches to deal again that no deal made; {fix}")
    counts = {k: data.get(k, np.zeros((0, 2), np.int64)) for k in BY_EPOCH}
    for what, by_epoch in zip(BY_EPOCH.values(), counts.values()):
        if (by_epoch.dtype != np.int64 or by_epoch.ndim != 2 or by_epoch.shape[1] != 2 or (by_epoch < 0).any()
                or (dealt is not None and by_epoch[:, 1].sum() > dealt)):
            raise UsageError(f"checkpoint {path} holds more batches {what} than were dealt; {fix}")
    per_worker = {k[len(WORKER_PREFIX):]: a for k, a in data.items() if k.startswith(WORKER_PREFIX)}
    if any(a.dtype != np.float32 or a.ndim != 2 or a.shape[1] != params.size or not np.isfinite(a).all()
           for a in per_worker.values()) or len({len(a) for a in per_worker.values()}) > 1:
        raise UsageError(f"checkpoint {path} holds workers' own arrays (error feedback, inner optimizer) that do not "
                         f"fit its parameters; {fix}")
    return TrainState(params=params, global_step=int(data["global_step"]), opt_t=int(data[OPT_COUNT]),
                      opt_state=opt_state, positions=[int(p) for p in data["positions"]], ema=data.get("ema"),
                      dealt=dealt, deal_shards=shards, redeal=[(int(a), int(b)) for a, b in redeal],
                      per_worker=per_worker, **{k: {int(e): int(n) for e, n in a} for k, a in counts.items()})


def saved_fingerprint(path: Path) -> dict:
    """The fingerprint a checkpoint was written with (load() has validated the file)."""
    with np.load(path, allow_pickle=False) as z:
        return json.loads(str(z["fingerprint"]))


def set_aside(directory: Path) -> Path | None:
    """--fresh: move earlier checkpoints into a subfolder so that the new run's pruning
    (--keep-checkpoints) never deletes them. Returns that folder, or None if there were none."""
    return atomic.set_aside(list_checkpoints(directory), directory)


def load_latest(directory: Path, fp: dict | None = None) -> tuple[Path, TrainState] | None:
    found = list_checkpoints(directory)
    if not found:
        return None
    return found[-1], load(found[-1], fp)
