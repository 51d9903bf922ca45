"""Command line: argparse -> TrainConfig, the per-rank flow, and error handling.

Flow on every rank: parse -> setup (data, device, model) -> agree on errors -> train -> report.
A UsageError anywhere before training is shared with allgather, so every rank exits 2 and
rank 0 prints one line; nobody waits for a peer that already left. An unexpected exception
during training aborts the whole job (MPI_Abort) instead of leaving peers hanging.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

from mpitrain.core.blas import pin_blas_threads
from mpitrain.core.config import TrainConfig, UsageError
from mpitrain.core.config_checks import validate
from mpitrain.core.config_io import flag_name, parse_straggler
from mpitrain.core.options import SECTIONS
from mpitrain.launch.mpiimpl import launcher_rank
from mpitrain.version import __version__


SUBCOMMANDS = {"launch": "mpitrain.launch.command", "evaluate": "mpitrain.duties.evaluation", "plot": "mpitrain.duties.plot",
               "run": "mpitrain.launch.run_script"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit 2 on each rank by itself
        if "-np" in message.split() or "-n" in message.split():  # the launcher's flag, given to mpitrain
            raise UsageError(f"{message}: the number of processes is mpirun's flag, not mpitrain's; run "
                             f"`mpirun -np 3 python -m mpitrain ...`")
        raise UsageError(f"{message}{self._did_you_mean(message)} (see python -m mpitrain --help)")

    def _did_you_mean(self, message: str) -> str:
        """`--eopchs` -> "; did you mean --epochs?" (the API says the same of a keyword)."""
        import difflib

        if not message.startswith("unrecognized arguments:"):
            return ""
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        typo = message.split(":", 1)[1].split()[0].split("=")[0]
        close = difflib.get_close_matches(typo, flags, n=1)
        return f"; did you mean {close[0]}?" if close else ""


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


def _value_type(f: dataclasses.Field):
    """str/int/float from the field's annotation ("int | None" -> int); flags with a shape of their
    own (--hidden, --straggler) have their parser in PARSERS."""
    return {"str": str, "int": int, "float": float}[f.type.removesuffix(" | None")]


PARSERS = {"hidden": _hidden, "stragglers": _straggler}


def build_parser(every_flag: bool = True) -> argparse.ArgumentParser:
    """The parser, generated from TrainConfig's fields: each one's flag, help, default and choices
    are declared once, in config.py (the Python API's signature comes from the same place). It
    parses every flag; `every_flag` False: its help shows the ones a newcomer changes first
    (Option.first), section by section in options.SECTIONS' order, and says where the rest are."""
    p = _Parser(
        prog="mpitrain",
        allow_abbrev=False,  # `--epoch 3` is a typo, not --epochs: say so instead of guessing
        description="Data-parallel training over MPI: rank 0 is the parameter server, ranks 1..N-1 are workers. "
                    "Run with `mpirun -np 3 python -m mpitrain` (1 server + 2 workers); one process trains locally. "
                    "Other commands: `mpitrain launch -f HOSTFILE ...`, `mpitrain evaluate CHECKPOINT`, "
                    "`mpitrain plot RUN_DIR... -o curves.png`, `mpitrain run SCRIPT [ARGS]` (your script, "
                    "supervised as this command's ranks are).",
        add_help=False,
        epilog=None if every_flag else f"{sum(1 for f in dataclasses.fields(TrainConfig) if not f.metadata['option'].first)} "
               "more flags (parallelism, faults, tuning, devices): python -m mpitrain --help-all; each explained in "
               "docs/flags.md.",
    )
    groups = {name: p.add_argument_group(name) for name in SECTIONS}
    for f in dataclasses.fields(TrainConfig):
        opt = f.metadata["option"]
        group = groups[opt.group]
        words = opt.default_words(f.default)
        text = (opt.help + (f" (default: {words})" if words else "")).replace("%", "%%")
        kw = {"dest": f.name, "default": f.default}
        if f.name == "stragglers":
            kw.update(action="append", type=PARSERS[f.name], default=[], metavar=opt.metavar)
        elif f.type in ("bool", "bool | None"):  # None: decided at run time (--overlap)
            kw["action"] = argparse.BooleanOptionalAction if f.default is not False else "store_true"
        else:
            kw.update(type=PARSERS.get(f.name) or _value_type(f), choices=opt.choice_list(), metavar=opt.metavar)
            if opt.bare is not None:
                kw.update(nargs="?", const=opt.bare)
        action = group.add_argument(flag_name(f), **kw)
        # after: BooleanOptionalAction appends its own "(default: True)"
        action.help = text if every_flag or opt.first else argparse.SUPPRESS
    out = groups["output"]
    out.add_argument("-h", "--help", action="store_true", help="show the flags changed first and exit")
    out.add_argument("--help-all", action="store_true", help="show every flag and exit")
    out.add_argument("--version", action="store_true", help="print the version and exit")
    return p


def parse_args(argv: list[str]) -> tuple[TrainConfig | None, argparse.ArgumentParser]:
    """(config, parser); config is None when --help was asked for."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.help or ns.help_all:
        return None, build_parser(every_flag=ns.help_all)
    values = {k: v for k, v in vars(ns).items() if k not in ("help", "help_all", "version")}
    values["stragglers"] = tuple(values["stragglers"])
    return validate(TrainConfig(**values)), parser


def main(argv: list[str] | None = None) -> int:
    pin_blas_threads()  # before NumPy loads (core/blas.py)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:  # no MPI for these: launch starts mpirun itself
        import importlib

        try:
            return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
        except BrokenPipeError:  # `mpitrain evaluate ck | head -2`: the reader had enough, no traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit flush must not fail again
            return 0
    if "--version" in argv:
        if launcher_rank(os.environ) in (None, 0):  # under mpirun: once, not once per rank (no MPI needed to ask)
            print(f"mpitrain {__version__}")
        return 0
    from mpitrain.launch.supervise import supervise

    supervise()  # under hydra: a dying rank must not take its peers down (see supervise.py)
    from mpitrain.node import node_info, world

    try:  # before MPI starts: the flags say how it must (world); a bad flag is reported once it has, by every rank
        cfg, parser = parse_args(argv)
    except UsageError as e:
        cfg, parser, err = None, None, str(e)
    else:
        err = None
    if cfg is not None and cfg.join:
        from mpitrain.launch import faults

        faults.slow_start()
    comm = world(cfg)
    from mpi4py import MPI

    from mpitrain.trainer import lost_at_start_up, run  # imports mpi4py.MPI, which initialises MPI: after world()

    try:
        node = node_info(comm)  # collective: before anyone can fail
    except MPI.Exception as e:  # ... but a rank can die (ULFM reports it)
        lost_at_start_up(comm, e)
    if err is None and cfg is None:
        if comm.Get_rank() == 0:
            parser.print_help()
        return 0
    code = run(cfg, comm, node, err).code
    # The run is over (its summary written, MPI finalized). A stop signal from now on must not kill
    # the interpreter on its way out (Python puts the default handlers back while it shuts down:
    # measured, 2 of 66 chaos trials that signalled a rank as it ended exited 143 after "done"):
    # ignored, the process exits with the run's own code.
    from mpitrain.membership.stopping import handled

    for sig in handled():
        signal.signal(sig, signal.SIG_IGN)
    return code
