"""mpitrain: data-parallel training of softmax/MLP classifiers over MPI.

Rank 0 is the parameter server; ranks 1..N-1 are workers (NumPy or CuPy).

The Python API (mpitrain/api.py): train(**options), evaluate(checkpoint, ...), rank(), and the
errors they raise: UsageError, Diverged, TrainingFailed. Importing mpitrain loads none of them
until used, so `python -m mpitrain --help` stays fast.
"""

__version__ = "0.1.0"
__all__ = ["train", "evaluate", "rank", "UsageError", "Diverged", "TrainingFailed", "__version__"]


def __getattr__(name: str):
    if name in __all__[:-1]:
        from mpitrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'mpitrain' has no attribute {name!r}")
