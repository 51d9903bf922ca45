"""Command line: argparse -> TrainConfig, the per-rank flow, and error handling.

Flow on every rank: parse -> setup (data, device, model) -> agree on errors -> train -> report.
A UsageError anywhere before training is shared with allgather, so every rank exits 2 and
rank 0 prints one line; nobody waits for a peer that already left. An unexpected exception
during training aborts the whole job (MPI_Abort) instead of leaving peers hanging.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from mpitrain import __version__
from mpitrain.config import (COMPRESSIONS, DEVICES, LR_SCALINGS, MODES, WAITS, TrainConfig, UsageError,
                             defaults, model_names, optimizer_names, parse_straggler, validate)

# One BLAS thread per rank: at these matrix sizes two threads are slower than one, and ranks
# already share the cores. Set before NumPy loads; an explicit user setting wins.
BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


SUBCOMMANDS = {"launch": "mpitrain.launch", "evaluate": "mpitrain.evaluation", "plot": "mpitrain.plot"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit 2 on each rank by itself
        if "-np" in message.split() or "-n" in message.split():  # the launcher's flag, given to mpitrain
            raise UsageError(f"{message}: the number of processes is mpirun's flag, not mpitrain's; run "
                             f"`mpirun -np 3 python -m mpitrain ...`")
        raise UsageError(f"{message} (see python -m mpitrain --help)")


def _hidden(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hidden takes comma-separated widths like 256,128, not {text!r}") from None
    if not sizes:
        raise argparse.ArgumentTypeError("--hidden needs at least one width, e.g. --hidden 100")
    return sizes


def _straggler(text: str):
    try:
        return parse_straggler(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    d = defaults()
    p = _Parser(
        prog="mpitrain",
        allow_abbrev=False,  # `--epoch 3` is a typo, not --epochs: say so instead of guessing
        description="Data-parallel training over MPI: rank 0 is the parameter server, ranks 1..N-1 are workers. "
                    "Run with `mpirun -np 3 python -m mpitrain` (1 server + 2 workers); one process trains locally. "
                    "Other commands: `mpitrain launch -f HOSTFILE ...`, `mpitrain evaluate CHECKPOINT`, "
                    "`mpitrain plot RUN_DIR... -o curves.png`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        add_help=False,
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--mode", choices=MODES, default=d.mode,
                   help="async: workers push gradients to / pull parameters from rank 0 independently; "
                        "sync: workers average gradients with Allreduce every step")
    g.add_argument("--num-ps", type=int, default=d.num_ps, metavar="K",
                   help="parameter servers: ranks 0..K-1 each own one slice of the parameters (its optimizer state "
                        "and moving average too); rank 0 stays the chief that evaluates, logs and checkpoints")
    g.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=d.overlap,
                   help="async: receive the next parameters while computing the next gradient "
                        "(gradients one exchange staler, no idle round trip)")
    g.add_argument("--compress", choices=COMPRESSIONS, default=d.compress,
                   help="send gradients and parameters as float16 or bfloat16 (half the traffic; bf16 converts "
                        "6x faster on a CPU); accumulate and update in float32")

    g.add_argument("--quorum", type=int, default=d.quorum, metavar="Q",
                   help="sync: each update averages the first Q fresh gradients; later ones are dropped "
                        "and counted (default: all workers, a plain Allreduce)")
    g.add_argument("--max-staleness", type=int, default=d.max_staleness, metavar="S",
                   help="async: hold back a worker's reply so that no applied gradient is more than S updates "
                        "stale (implies --no-overlap; default: unbounded)")
    g.add_argument("--staleness-lr", action="store_true", default=d.staleness_lr,
                   help="async: divide each step's learning rate by its gradient's staleness (Zhang et al. 2016)")
    g.add_argument("--straggler", action="append", type=_straggler, default=[], dest="stragglers",
                   metavar="RANK:SEC|RANK:xF",
                   help="slow a worker down on every step: add SEC seconds, or take F times as long "
                        "(repeatable; for tests, demos and benchmarks)")

    g.add_argument("--wait", choices=WAITS, default=d.wait,
                   help="how workers wait in collectives: spin (MPICH's blocking Allreduce), or yield "
                        "(Iallreduce + test-and-sleep); auto yields when a node has more computing ranks than cores")
    g.add_argument("--worker-timeout", type=float, default=d.worker_timeout, metavar="SEC",
                   help="declare a rank lost after SEC seconds without a heartbeat (0: never). Async: rank 0 "
                        "finishes with the other workers (launch with `mpirun -disable-auto-cleanup`); "
                        "sync: the job stops, naming the rank")

    g = p.add_argument_group("model")
    g.add_argument("--model", choices=model_names(), default=d.model, help="softmax regression or ReLU MLP")
    g.add_argument("--hidden", type=_hidden, default=d.hidden, metavar="W[,W...]",
                   help="MLP hidden layer widths, e.g. 500 or 256,128")
    g.add_argument("--l2", type=float, default=d.l2, help="L2 weight decay on weights (not biases)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--optimizer", choices=optimizer_names(), default=d.optimizer)
    g.add_argument("--lr", type=float, default=d.lr, help="learning rate")
    g.add_argument("--lr-decay", type=float, default=d.lr_decay,
                   help="multiply the learning rate by this per epoch of global data (1 = constant)")
    g.add_argument("--lr-scaling", choices=LR_SCALINGS, default=d.lr_scaling,
                   help="sync: multiply --lr by the workers averaged into each update (linear; the default in sync "
                        "mode, as Horovod), or keep it (none). Async: none")
    g.add_argument("--warmup-epochs", type=float, default=d.warmup_epochs, metavar="E",
                   help="sync with linear scaling: ramp the learning rate from --lr to its scaled value over E "
                        "epochs of global data (0: scaled from the first step)")
    g.add_argument("--momentum", type=float, default=d.momentum, help="momentum coefficient (--optimizer momentum)")
    g.add_argument("--ema-decay", type=float, default=d.ema_decay, metavar="D",
                   help="keep a moving average of the weights on the chief (e.g. 0.99); evaluated beside the raw "
                        "weights and checkpointed")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="minibatch size per worker and step")
    g.add_argument("--epochs", type=int, default=d.epochs,
                   help="passes of each worker over its shard (default 50 when --steps is not given either)")
    g.add_argument("--steps", type=int, default=d.steps, help="stop after this many global steps")
    g.add_argument("--seed", type=int, default=d.seed, help="seeds initialisation, shuffling and synthetic data")
    g.add_argument("--divergence-factor", type=float, default=d.divergence_factor, metavar="F",
                   help="stop (exit 4, like a NaN loss) when the smoothed training loss exceeds F times the "
                        "loss the run started from; 0 turns the check off")

    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=d.dataset, metavar="NAME",
                   help="digits: scikit-learn's bundled 8x8 digits (offline); mnist/fashion_mnist: IDX files in "
                        "--data-dir, else tensorflow-datasets; synthetic: seeded clusters; npz:PATH: your own "
                        "x_train, y_train, x_test, y_test arrays; tfds:NAME: any prepared tfds image-classification "
                        "dataset (e.g. tfds:kmnist, tfds:cifar10)")
    g.add_argument("--data-dir", default=d.data_dir, metavar="DIR",
                   help="folder with the four MNIST-format IDX .gz files, or a tfds data dir")
    g.add_argument("--train-split", default=d.train_split, metavar="SPLIT", help="tfds:NAME: the split to train on")
    g.add_argument("--test-split", default=d.test_split, metavar="SPLIT", help="tfds:NAME: the split to evaluate on")
    g.add_argument("--synthetic-samples", type=int, default=d.synthetic_samples, metavar="N")
    g.add_argument("--synthetic-features", type=int, default=d.synthetic_features, metavar="D")

    g = p.add_argument_group("device")
    g.add_argument("--device", choices=DEVICES, default=d.device,
                   help="auto: CuPy on a GPU when one is usable, else NumPy; workers bind GPU node-local-rank %% #GPUs")
    g.add_argument("--cuda-aware", action="store_true", default=d.cuda_aware,
                   help="hand GPU buffers straight to MPI (needs a CUDA-aware MPI build) instead of staging "
                        "them through pinned host memory")

    g = p.add_argument_group("checkpoints (rank 0 writes them; a run resumes from the newest)")
    g.add_argument("--checkpoint-dir", default=d.checkpoint_dir, metavar="DIR",
                   help="save checkpoints here, and resume from the newest one found here")
    g.add_argument("--checkpoint-every-secs", type=float, default=d.checkpoint_every_secs, metavar="S")
    g.add_argument("--checkpoint-every-steps", type=int, default=d.checkpoint_every_steps, metavar="N")
    g.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, metavar="K")
    g.add_argument("--fresh", action="store_true", default=d.fresh,
                   help="ignore checkpoints in --checkpoint-dir and start from scratch (they are kept)")

    g = p.add_argument_group("output")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=d.progress,
                   help="tqdm bar on rank 0's stderr")
    g.add_argument("--summary-json", default=d.summary_json, metavar="PATH", help="write the run summary here")
    g.add_argument("--log-dir", default=d.log_dir, metavar="DIR",
                   help="write events.jsonl and TensorBoard event files here (rank 0)")
    g.add_argument("--log-every", type=int, default=d.log_every, metavar="N", help="log training scalars every N global steps")
    g.add_argument("--eval-every", type=int, default=d.eval_every, metavar="N",
                   help="evaluate rank 0's parameters on the test set every N global steps (summary: eval_history)")
    g.add_argument("--straggler-report", type=float, default=d.straggler_report, metavar="X",
                   help="name a worker whose median step time is X times the other workers' median (0: never)")
    g.add_argument("--stall-warning", type=float, default=d.stall_warning, metavar="SEC",
                   help="after SEC seconds without progress, say what is waited for and who has not arrived (0: never)")
    g.add_argument("--timeline", default=d.timeline, metavar="PATH",
                   help="write a Chrome/Perfetto trace of every rank's phases here (open in ui.perfetto.dev)")
    g.add_argument("--timeline-steps", type=int, default=d.timeline_steps, metavar="N",
                   help="--timeline keeps each rank's first N steps and about its last N")
    g.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    g.add_argument("--version", action="store_true", help="print the version and exit")
    return p


def parse_args(argv: list[str]) -> tuple[TrainConfig | None, argparse.ArgumentParser]:
    """(config, parser); config is None when --help was asked for."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.help:
        return None, parser
    values = {k: v for k, v in vars(ns).items() if k not in ("help", "version")}
    values["stragglers"] = tuple(values["stragglers"])
    return validate(TrainConfig(**values)), parser


def launcher_rank(env=os.environ) -> int | None:
    """This process's rank as the launcher's environment tells it (MPICH/Slurm PMI, Open MPI), or None."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if env.get(var, "").isdigit():
            return int(env[var])
    return None


def _pin_blas_threads() -> None:
    for var in BLAS_THREAD_VARS:
        os.environ.setdefault(var, "1")


def main(argv: list[str] | None = None) -> int:
    _pin_blas_threads()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:  # no MPI for these: launch starts mpirun itself
        import importlib

        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    if "--version" in argv:
        if launcher_rank() in (None, 0):  # under mpirun: once, not once per rank (no MPI needed to ask)
            print(f"mpitrain {__version__}")
        return 0
    from mpitrain.supervise import supervise

    supervise()  # under hydra: a dying rank must not take its peers down (see supervise.py)
    from mpitrain.runtime import node_info, world
    from mpitrain.trainer import run

    comm = world()
    node = node_info(comm)  # collective: before anyone can fail
    try:
        cfg, parser = parse_args(argv)
    except UsageError as e:
        cfg, parser, err = None, None, str(e)
    else:
        err = None
    if err is None and cfg is None:
        if comm.Get_rank() == 0:
            parser.print_help()
        return 0
    code = run(cfg, comm, node, err).code
    # The run is over (its summary written, MPI finalized). A stop signal from now on must not kill
    # the interpreter on its way out (Python puts the default handlers back while it shuts down:
    # measured, 2 of 66 chaos trials that signalled a rank as it ended exited 143 after "done"):
    # ignored, the process exits with the run's own code.
    from mpitrain.stopping import handled

    for sig in handled():
        signal.signal(sig, signal.SIG_IGN)
    return code
