"""mpitrain: data-parallel training of softmax/MLP classifiers over MPI.

Rank 0 is the parameter server; ranks 1..N-1 are workers (NumPy or CuPy).

The Python API (mpitrain/api.py): train(**options) -> Result, evaluate(checkpoint, ...),
dataset(name), rank(), size(), local_rank(), Model (the protocol a model of your own implements), and
the errors they raise: UsageError, Diverged, LostPeer,
TrainingFailed. Importing mpitrain loads none of them until used, so `python -m mpitrain --help`
stays fast; dir(mpitrain) lists them.
"""

from mpitrain.version import __version__

API = ("train", "evaluate", "dataset", "rank", "size", "local_rank", "Model", "Result", "UsageError", "Diverged",
       "TrainingFailed", "LostPeer")
__all__ = [*API, "__version__"]


def __getattr__(name: str):
    if name in API:
        from mpitrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'mpitrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
