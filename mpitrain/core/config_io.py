"""A TrainConfig as it leaves this process: compared with a peer's (the agreed fields), recorded
in the summary (JSON), and written back out as flags (the worker --respawn starts); and the one flag
with a text form of its own read in (--straggler)."""

from __future__ import annotations

from dataclasses import Field, fields

from mpitrain.core.config import TrainConfig, UsageError

# What a rank may set for itself: where it reads or writes on its own host, what it shows, how it
# computes and waits, and what rank 0 alone decides or writes. Every other field must be the same
# on every rank, or messages and collectives would not match (a worker without --ema-decay, or
# with another --steps, would send rank 0 something else than it expects, or stop at another
# step): agreement.agree_on_setup refuses the run in one line. A new field is agreed unless listed.
PER_RANK_FIELDS = frozenset({
    "data_dir", "device", "cuda_aware", "ps_device", "wait",  # this host's files and hardware
    "progress", "summary_json", "log_dir", "timeline", "timeline_steps",  # output (rank 0's, or this rank's spans)
    "straggler_report", "stall_warning",  # rank 0's reporting
    "fresh", "keep_checkpoints",  # rank 0 writes the checkpoints
    "join",  # the joiner's own way in (join.py); the job's flags are compared when it joins
    "respawn",  # rank 0 alone starts replacements (join.py)
    "spares",  # rank 0 alone holds the spares (spares.py): a worker respawned beside them has none
})


def agreed_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(TrainConfig) if f.name not in PER_RANK_FIELDS)


def disagreement(ours: dict, theirs: dict) -> str | None:
    """Where a peer's identity (agreement.identity: version, protocol, model, agreed flags) differs
    from ours, as "key theirs vs ours, ..."; None when it agrees. At start (every rank against
    rank 0) and when a worker joins (join.py)."""
    diff = [k for k in ours if theirs.get(k) != ours[k]]
    return ", ".join(f"{k} {theirs.get(k)} vs {ours[k]}" for k in diff) or None


def plain_value(cfg: TrainConfig, name: str):
    """A field as JSON and a peer rank can compare it: tuples as lists, a user's model object as
    its spec (each rank builds its own object; their specs must agree)."""
    value = getattr(cfg, name)
    if name == "model" and not isinstance(value, str):
        return value.spec
    return [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value


def as_record(cfg: TrainConfig) -> dict:
    """Every option, JSON-able: the summary's `config`."""
    return {f.name: plain_value(cfg, f.name) for f in fields(TrainConfig)}


def flag_name(f: Field) -> str:
    return f.metadata["option"].flag or "--" + f.name.replace("_", "-")


def as_argv(cfg: TrainConfig) -> list[str]:
    """The flags that give `cfg` back (each field not at its default), for the worker rank 0 starts
    itself (--respawn, join.py): parse_args(as_argv(cfg)) == cfg. ValueError for what no flag
    says (a Python API caller's model object)."""
    out: list[str] = []
    for f in fields(TrainConfig):
        value, flag = getattr(cfg, f.name), flag_name(f)
        if value == f.default:
            continue
        if f.name == "stragglers":
            for rank, kind, amount in value:
                out += [flag, f"{rank}:{'x' if kind == 'factor' else ''}{amount!r}"]
        elif f.type in ("bool", "bool | None"):
            out.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif f.name == "hidden":
            out += [flag, ",".join(map(str, value))]
        elif isinstance(value, bool) and f.type == "float | None":  # the Python API's staleness_lr=True
            out += [flag, repr(float(value))]
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
            out += [flag, repr(value) if isinstance(value, float) else str(value)]
        else:
            raise ValueError(f"{flag} {value!r} has no command-line form")
    return out


def parse_straggler(text: str) -> tuple[int, str, float]:
    """RANK:SECONDS (added to every step) or RANK:xFACTOR (every step takes FACTOR times as long)."""
    rank_s, sep, amount = text.partition(":")
    try:
        if not sep:
            raise ValueError
        rank = int(rank_s)
        if amount.lower().startswith("x"):
            kind, value = "factor", float(amount[1:])
        else:
            kind, value = "delay", float(amount)
    except ValueError:
        raise UsageError(f"--straggler takes RANK:SECONDS or RANK:xFACTOR, e.g. 3:0.01 or 3:x5, not {text!r}") from None
    if rank < 1:
        raise UsageError(f"--straggler {text}: rank {rank} is the parameter server (or invalid); name a worker rank >= 1")
    if kind == "delay" and not value >= 0:
        raise UsageError(f"--straggler {text}: the delay must be zero or more seconds")
    if kind == "factor" and not value >= 1:
        raise UsageError(f"--straggler {text}: the factor must be at least 1 (x5 makes each step 5 times as long)")
    return rank, kind, value
