"""Before a single buffer is exchanged: every rank sets up, then all compare notes (an error on
any rank, or a rank whose code, wire format or flags differ from rank 0's, ends the job in one line)."""

from __future__ import annotations

import sys

from mpitrain import modes
from mpitrain.core.config import TrainConfig, UsageError
from mpitrain.core.config_io import agreed_fields, disagreement, plain_value
from mpitrain.core.console import say
from mpitrain.exchange.protocol import VERSION as PROTOCOL_VERSION
from mpitrain.node import Node
from mpitrain.runtime import Context, setup
from mpitrain.version import __version__


def agree_on_setup(cfg: TrainConfig | None, comm, node: Node, err: str | None,
                   quiet: bool = False, data=None) -> tuple[Context | None, str | None]:
    """Every rank sets up, then all compare notes. (None, the line rank 0 printed) if any failed;
    `quiet` (the Python API, which raises it): the line is not printed. `data`: runtime.setup's."""
    ctx = None
    if err is None:
        try:
            ctx = setup(cfg, comm, node, modes.of, data)
        except UsageError as e:
            err = str(e)
    notes = comm.allgather((err, identity(ctx)))  # setup-time only; every rank reaches it on every path
    failed = [(r, e) for r, (e, _) in enumerate(notes) if e]
    if not failed:
        failed = mismatches([ident for _, ident in notes])
    if not failed:
        return ctx, None
    rank, message = failed[0]
    where = "" if len(failed) == comm.Get_size() else f" on rank {rank}"
    line = f"mpitrain: error{where}: {message}"
    if comm.Get_rank() == 0 and not quiet:
        say(line, sys.stderr)
    return None, line


# What every rank must agree on before exchanging a single buffer: the code, the wire format, and
# every flag not marked per-rank in config.py (a mixed install or MPMD launch fails here, in one
# line, instead of in a truncated message, on garbage, or in a hang).
AGREED = agreed_fields()


def identity(ctx: Context | None) -> dict | None:
    return None if ctx is None else identity_of(ctx.cfg, ctx.model)


def identity_of(cfg: TrainConfig, model) -> dict:
    return {"mpitrain": __version__, "protocol": PROTOCOL_VERSION, "layer_sizes": list(model.sizes),
            **{k: plain_value(cfg, k) for k in AGREED}}


def mismatches(idents: list[dict | None]) -> list[tuple[int, str]]:
    out = []
    for rank, ident in enumerate(idents[1:], 1):
        detail = disagreement(idents[0], ident)
        if detail:
            out.append((rank, f"it disagrees with rank 0 ({detail}); start every rank from the same "
                              f"mpitrain install with the same flags"))
    return out
