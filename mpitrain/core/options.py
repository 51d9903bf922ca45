"""How a TrainConfig field is offered to users: its --help section, words and choices (Option), and
the field makers of each section (config.py declares every option with one of them; cli.py builds
its parser from the metadata). Imports nothing heavy, as config.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Option:
    """How a TrainConfig field is offered to users: the command line (cli.py builds its parser from
    these), the Python API's signature and docstring (api.py), and --help. Declared with each field (config.py)."""

    group: str  # --help's section
    help: str  # one line, in the user's terms
    shown: str | Callable[[], str] | None = None  # the default in words, where its value would not say it
    metavar: str | None = None
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None  # a callable: a registry, asked late
    flag: str | None = None  # the flag, where it is not --NAME-WITH-DASHES (--straggler, repeatable)
    bare: float | None = None  # the value of the flag given alone (--delay-compensation), where it may be
    first: bool = False  # one of the flags a newcomer changes first: shown by --help (the rest by --help-all)

    def choice_list(self) -> tuple[str, ...] | None:
        return self.choices() if callable(self.choices) else self.choices

    def default_words(self, default) -> str | None:
        """The default as --help shows it: in words where given, else the value (None: not shown)."""
        if self.shown is not None:
            return self.shown() if callable(self.shown) else self.shown
        if isinstance(default, bool):  # a switch (--fresh) is off unless given; --no-X turns one off
            return "on" if default else None
        return None if default is None else f"{default:g}" if isinstance(default, float) else str(default)


def _section(group: str):
    """A field maker for one --help section: `NAME: type = PARALLELISM(default, "help", ...)`."""

    def option(default, help: str, **how):
        return field(default=default, metadata={"option": Option(group, help, **how)})

    return option


# --help's sections, in the order a newcomer reads them: what is trained, on what, how and for how
# long; then what comes out; then parallelism, faults and tuning.
SECTIONS = ("model", "data", "training (mode, length, optimizer)", "output", "checkpoints (rank 0 writes them; a run resumes from the newest)",
            "parallelism", "device")
MODEL, DATA, TRAINING, OUTPUT, CHECKPOINTS, PARALLELISM, DEVICE = map(_section, SECTIONS)
