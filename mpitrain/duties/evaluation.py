"""`mpitrain evaluate CHECKPOINT`: test-set accuracy, loss and confusion matrix of a checkpoint.

    mpitrain evaluate runs/exp1/ckpt-000002000.npz --data-dir /data/mnist   # on the dataset it was trained on

One process, no MPI. The model's layer sizes come from the checkpoint's fingerprint; a dataset
whose feature or class count does not fit them is refused in one line (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from mpitrain.core.config import TrainConfig, UsageError
from mpitrain.core.config_checks import validate
from mpitrain.core.console import say
from mpitrain.core.exitcodes import ExitCode
from mpitrain.duties import checkpoint
from mpitrain.duties.metrics import write_json_atomic


def confusion_matrix(y_true: np.ndarray, y_pred: np.ndarray, classes: int) -> np.ndarray:
    """counts[i, j] = examples of class i predicted as j."""
    return np.bincount(y_true * classes + y_pred, minlength=classes * classes).reshape(classes, classes)


def format_matrix(m: np.ndarray) -> list[str]:
    width = max(5, len(str(int(m.max()))) + 1)
    head = "true\\pred" + "".join(f"{j:>{width}}" for j in range(m.shape[1]))
    return [head] + [f"{i:>9}" + "".join(f"{v:>{width}}" for v in row) for i, row in enumerate(m)]


def trained_on(path: Path, saved: dict) -> str:
    """The --dataset a checkpoint was trained on. An npz is found where it was (the absolute path the
    checkpoint records), from whatever folder this runs in."""
    from mpitrain.core.config import NPZ_PREFIX

    name = saved.get("dataset") or "digits"
    if not name.startswith(NPZ_PREFIX):
        return name
    where = saved.get("dataset_path")
    if where and Path(where).is_file():
        return NPZ_PREFIX + where
    was = f"at {where}, which is not there now" if where else "its path relative to the folder it was trained in"
    raise UsageError(f"checkpoint {path} was trained on {name} ({was}); pass the file with --dataset npz:PATH")


def evaluate(path: str, dataset: str | None, data_dir: str | None, model=None) -> dict:
    """A checkpoint's test accuracy, loss and confusion matrix, on `dataset` or, when None, on the
    one it was trained on (its fingerprint's name; synthetic data is made again from the
    checkpoint's seed and feature count). `model`: a model of the user's own (the API); the
    built-ins are rebuilt from the checkpoint's spec."""
    from mpitrain.core.data import load_dataset
    from mpitrain.core.model import builtin_spec, from_sizes, is_builtin

    p = Path(path)
    if p.is_dir():  # a --checkpoint-dir: its newest checkpoint, as a resumed run would take
        found = checkpoint.list_checkpoints(p)
        if not found:
            raise UsageError(f"{path} holds no ckpt-*.npz checkpoint; pass a --checkpoint-dir that has one, or a file")
        p = found[-1]
    elif not p.is_file():
        raise UsageError(f"checkpoint {path} does not exist; pass a ckpt-*.npz file or a --checkpoint-dir")
    state = checkpoint.load(p)
    saved = checkpoint.saved_fingerprint(p)
    sizes = tuple(saved["layer_sizes"])
    spec = saved.get("model") or builtin_spec(sizes)  # written before models had a spec
    if model is None:
        if not is_builtin(spec):
            raise UsageError(f"checkpoint {p} holds a model of your own ({spec.get('kind')}); evaluate it from Python: "
                             f"mpitrain.evaluate({str(p)!r}, model=YourModel(...))")
        model = from_sizes(sizes)
    else:
        model = model.with_backend(np)
        if model.spec != spec:
            raise UsageError(f"checkpoint {p} is of the model {spec}, not {model.spec}; pass the model it was "
                             f"trained with")
    dataset, own = (dataset, False) if dataset else (trained_on(p, saved), True)
    remade = {"seed": int(saved.get("seed", 0)), "synthetic_features": sizes[0]} if own else {}  # synthetic: the same
    data = load_dataset(validate(TrainConfig(dataset=dataset, data_dir=data_dir, **remade)))
    if (data.n_features, data.n_classes) != (sizes[0], sizes[-1]):
        raise UsageError(f"{dataset} has {data.n_features} features and {data.n_classes} classes but the checkpoint's "
                         f"model is {'-'.join(map(str, sizes))}; evaluate it on the dataset it was trained on")
    out = {"checkpoint": str(p), "global_step": state.global_step, "dataset": dataset, "dataset_from_checkpoint": own,
           "model_description": model.description, "test_examples": int(len(data.y_test))}
    for name, params in (("", state.params), ("ema_", state.ema)):
        if params is None:
            continue
        loss, acc, pred = model.evaluate(params, data.x_test, data.y_test)
        out[f"{name}test_accuracy"], out[f"{name}test_loss"] = acc, loss
        out[f"{name}confusion_matrix"] = confusion_matrix(data.y_test, pred, data.n_classes).tolist()
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mpitrain evaluate", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a ckpt-*.npz file, or a --checkpoint-dir (its newest checkpoint)")
    p.add_argument("--dataset", default=None, help="as for training: digits, mnist, npz:PATH, tfds:NAME, ... "
                   "(default: the one the checkpoint was trained on)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--summary-json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    try:
        out = evaluate(args.checkpoint, args.dataset, args.data_dir)
    except UsageError as e:
        say(f"mpitrain evaluate: error: {e}", sys.stderr)
        return ExitCode.USAGE
    whose = ", the checkpoint's own" if out["dataset_from_checkpoint"] else ""
    say(f"{out['checkpoint']} (global step {out['global_step']}, {out['model_description']}) on {out['dataset']} "
        f"test set ({out['test_examples']} examples{whose}):")
    say(f"  accuracy {out['test_accuracy']:.4f} | loss {out['test_loss']:.4f}"
        + (f" | EMA accuracy {out['ema_test_accuracy']:.4f}, loss {out['ema_test_loss']:.4f}" if "ema_test_accuracy" in out else ""))
    for line in format_matrix(np.array(out["confusion_matrix"])):
        say("  " + line)
    if args.summary_json:
        write_json_atomic(args.summary_json, out)
    return 0
