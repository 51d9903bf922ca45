"""Datasets, scaling to [0, 1], and sharding into per-worker minibatches.

Every loader returns a `Dataset` of host NumPy arrays: features float32 in [0, 1], labels int64.
A problem with the user's data raises UsageError (one line, exit 2); nothing here hangs on a
network that is not there.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import socket
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpitrain.core.config import NPZ_PREFIX, TFDS_PREFIX, TrainConfig, UsageError
from mpitrain.core.ledger import Deal

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
IDX_IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions
IDX_LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension
DIGITS_SPLIT_SEED = 20161  # fixed: the digits train/test split never depends on --seed
DIGITS_TEST_FRACTION = 0.2
# Where tfds downloads from; probed with a short connect so offline machines fail in seconds.
TFDS_DOWNLOAD_HOST = ("storage.googleapis.com", 443)


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    n_classes: int
    notes: list[str] = field(default_factory=list)  # what rank 0 says of the data before training (a warning)

    @property
    def n_features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])


# Datasets whose label range is known: a label outside it is a broken file, not a new class.
KNOWN_CLASSES = {"mnist": 10, "fashion_mnist": 10}
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def load_dataset(cfg: TrainConfig) -> Dataset:
    if cfg.dataset == "digits":
        return load_digits()
    if cfg.dataset == "synthetic":
        return make_synthetic(cfg.synthetic_samples, cfg.synthetic_features, 10, cfg.seed)
    if cfg.dataset.startswith(NPZ_PREFIX):
        return load_npz(cfg.dataset[len(NPZ_PREFIX):])
    if cfg.dataset.startswith(TFDS_PREFIX):
        return load_tfds(cfg.dataset[len(TFDS_PREFIX):], cfg.data_dir, (cfg.train_split, cfg.test_split))
    return load_mnist_like(cfg.dataset, cfg.data_dir)


def scaled_features(x: np.ndarray, where: str) -> np.ndarray:
    """One row per example, float32: uint8 pixels scaled to [0, 1], floats as they are (an npz's
    are then standardised: load_npz)."""
    if x.ndim < 2 or x.shape[0] == 0:
        raise UsageError(f"{where} must hold one row (or image) per example, at least one; got shape {x.shape}")
    if x.dtype == np.uint8:
        return pixels(x)
    if x.dtype.kind != "f":
        raise UsageError(f"{where} has dtype {x.dtype}; features must be uint8 (scaled to [0, 1]) or float "
                         f"(standardised): convert with .astype(np.float32)")
    out = x.reshape(x.shape[0], -1).astype(np.float32)
    if not np.isfinite(out).all():
        raise UsageError(f"{where} holds NaN or infinite values; drop or impute them before training")
    return out


def pixels(x: np.ndarray) -> np.ndarray:
    """uint8 images -> float32 rows in [0, 1], divided in place: one array of the set's size, not two (the
    second's first touch of its pages cost as much as the division: an MNIST-sized set, twice, at every start)."""
    out = x.reshape(x.shape[0], -1).astype(np.float32)
    out /= np.float32(255.0)
    return out


def standardised(x_train: np.ndarray, x_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float features: each feature minus the training set's mean, over its standard deviation
    (1 where it is constant), for both splits. Raw features on their own scales (pixel counts
    0..16, wine's 0.1..1680) otherwise train to chance at the default learning rate."""
    mean = x_train.mean(axis=0, dtype=np.float64)
    std = x_train.std(axis=0, dtype=np.float64)
    std[std == 0] = 1.0
    return (((x_train - mean) / std).astype(np.float32), ((x_test - mean) / std).astype(np.float32))


def checked_classes(path: str, y_train: np.ndarray, y_test: np.ndarray) -> tuple[int, list[str]]:
    """The number of classes, C = the largest training label + 1, and rank 0's notes. A test label
    of C or more is refused (the model would have no output for it); a class under C that never
    occurs in training is said (the model cannot learn it)."""
    classes = int(y_train.max()) + 1
    if classes < 2:
        raise UsageError(f"{path}: every label in y_train is 0; a classifier needs at least two classes")
    if y_test.size and y_test.max() >= classes:
        raise UsageError(f"{path}: y_test has label {int(y_test.max())}, but y_train's labels go up to {classes - 1}: "
                         f"the model would have no output for it; label both splits with the same classes 0..C-1")
    missing = sorted(set(range(classes)) - set(np.unique(y_train).tolist()))
    notes = []
    if missing:
        in_test = sorted(set(missing) & set(np.unique(y_test).tolist()))
        also = f" (y_test has {', '.join(map(str, in_test))})" if in_test else ""
        notes.append(f"mpitrain: warning: {path}: class {', '.join(map(str, missing))} never appears in y_train"
                     f"{also}: the model cannot learn it; relabel the classes 0..C-1 without gaps")
    return classes, notes


def class_labels(y: np.ndarray, where: str, n: int, classes: int | None = None) -> np.ndarray:
    """Integer labels 0..C-1, one per example (C given for a dataset that declares it); a column
    (n, 1), as scikit-learn and pandas hand them out, is taken as the labels it holds."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.dtype.kind not in "iu" or y.ndim != 1:
        # Names ('cat', 'class_0') are numbered, not cast: astype raises on them.
        fix = ("number them with np.unique(np.concatenate([y_train, y_test]), return_inverse=True) (one "
               "numbering for both)" if y.dtype.kind in "USO" else "e.g. y.astype(np.int64)")
        raise UsageError(f"{where} must be a 1-D array of integer class labels 0..C-1 (got dtype {y.dtype}, "
                         f"shape {y.shape}); {fix}")
    if y.shape[0] != n:
        raise UsageError(f"{where} has {y.shape[0]} labels for {n} examples; they must match one to one")
    if y.size and y.min() < 0:
        raise UsageError(f"{where} has a negative label ({int(y.min())}); labels are classes 0..C-1")
    if classes is not None and y.size and y.max() >= classes:
        raise UsageError(f"{where} has label {int(y.max())}, but this dataset has {classes} classes "
                         f"(0..{classes - 1}); the file is corrupted or from another dataset")
    return y.astype(np.int64)


def load_npz(path: str) -> Dataset:
    """--dataset npz:PATH: the user's own arrays, x_train/y_train/x_test/y_test."""
    fix = f"write it with np.savez({path!r}, x_train=..., y_train=..., x_test=..., y_test=...)"
    if not Path(path).is_file():
        raise UsageError(f"--dataset npz:{path}: no such file; {fix}")
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic == b"\x93NUMPY":
        raise UsageError(f"{path} is a single .npy array, not an .npz archive; {fix}")
    if not magic.startswith(b"PK"):  # np.load would take anything else for a pickle
        raise UsageError(f"{path} is not a readable .npz file (not a zip archive); {fix}")
    try:
        with np.load(path, allow_pickle=False) as f:  # a file a user hands us: never unpickle
            missing = [k for k in NPZ_KEYS if k not in f.files]
            if missing:
                raise UsageError(f"{path} has no {', '.join(missing)} (it has: {', '.join(f.files) or 'nothing'}); {fix}")
            arrays = {k: f[k] for k in NPZ_KEYS}
    except UsageError:
        raise
    except ValueError as e:  # object arrays refused without pickle, or a damaged member
        raise UsageError(f"{path} cannot be read without pickle ({e}); save plain numeric arrays: {fix}") from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # truncated, or a member's CRC is wrong
        raise UsageError(f"{path} is corrupt or truncated ({type(e).__name__}: {e}); {fix} again") from None
    x_train = scaled_features(arrays["x_train"], f"{path}: x_train")
    x_test = scaled_features(arrays["x_test"], f"{path}: x_test")
    if x_train.shape[1] != x_test.shape[1]:
        raise UsageError(f"{path}: x_train has {x_train.shape[1]} features per example but x_test "
                         f"{x_test.shape[1]}; both splits need the same shape")
    if arrays["x_train"].dtype.kind == "f":  # uint8 pixels are already on one scale, [0, 1]
        x_train, x_test = standardised(x_train, x_test)
    y_train = class_labels(arrays["y_train"], f"{path}: y_train", x_train.shape[0])
    y_test = class_labels(arrays["y_test"], f"{path}: y_test", x_test.shape[0])
    classes, notes = checked_classes(path, y_train, y_test)
    return Dataset(f"{NPZ_PREFIX}{Path(path).name}", x_train, y_train, x_test, y_test, classes, notes)


# --- digits: the 8x8 handwritten digits that ship with scikit-learn ---------------------------

def _digits_csv() -> Path | None:
    """The CSV scikit-learn bundles, found without importing sklearn (that import costs ~1.5 s)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def load_digits() -> Dataset:
    path = _digits_csv()
    if path is not None:
        raw = np.loadtxt(path, delimiter=",", dtype=np.float32)
        x, y = raw[:, :-1], raw[:, -1].astype(np.int64)
    else:
        try:
            from sklearn.datasets import load_digits as sk_load_digits
        except ImportError:
            raise UsageError("--dataset digits needs scikit-learn: pip install scikit-learn") from None
        bunch = sk_load_digits()
        x, y = bunch.data.astype(np.float32), bunch.target.astype(np.int64)
    x /= 16.0  # pixel values are 0..16
    perm = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(y))
    n_test = int(round(len(y) * DIGITS_TEST_FRACTION))
    test, train = perm[:n_test], perm[n_test:]
    return Dataset("digits", x[train], y[train], x[test], y[test], 10)


# --- synthetic: seeded, learnable, any size ---------------------------------------------------

SYNTHETIC_ROWS = 1024  # rows of the synthetic set made at a time (6 MB of float64 at 784 features)


def make_synthetic(n: int, features: int, classes: int, seed: int) -> Dataset:
    """MNIST-like but generated: classes are overlapping Gaussian clusters in a 16-d latent
    space, projected to `features` dimensions and clipped to [0, 1] (about 2/3 zeros, like
    pen strokes on a blank page). Learnable to ~97% at 784 features; 1/6 held out for test."""
    rng = np.random.default_rng([seed, 0x5E7])
    latent = 16
    centres = rng.normal(0.0, 1.0, (classes, latent))
    projection = rng.normal(0.0, 1.0 / np.sqrt(latent), (latent, features))
    y = rng.integers(0, classes, size=n)
    z = centres[y] + rng.normal(0.0, 0.8, (n, latent))
    # np.clip(z @ projection - 0.5, 0, 1) as float32, a slice of rows at a time: the same numbers (each row's
    # own dot products; tests/test_data.py holds it to the one expression), without three float64 arrays of the
    # set's size (60,000 rows: 1.5 s, mostly first touches of fresh pages, at every start and every respawn)
    x = np.empty((n, features), np.float32)
    rows = np.empty((min(n, SYNTHETIC_ROWS), features))
    for at in range(0, n, SYNTHETIC_ROWS):
        part = rows[:min(n, at + SYNTHETIC_ROWS) - at]
        np.matmul(z[at:at + len(part)], projection, out=part)
        part -= 0.5
        np.clip(part, 0.0, 1.0, out=part)
        x[at:at + len(part)] = part
    n_test = max(1, n // 6)
    y = y.astype(np.int64)
    return Dataset("synthetic", x[n_test:], y[n_test:], x[:n_test], y[:n_test], classes)


# --- MNIST-format IDX files, read directly --------------------------------------------------------

def read_idx(path: Path, magic: int) -> np.ndarray:
    """Read one gzipped IDX file (the format of the MNIST distribution) into a uint8 array."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise UsageError(f"cannot read {path}: {e}; re-download the file (it must be a gzipped IDX file)") from None
    if len(data) < 4:
        raise UsageError(f"{path} is too short to be an IDX file; re-download it")
    got = int.from_bytes(data[:4], "big")
    if got != magic:
        raise UsageError(f"{path} has IDX magic number {got} where {magic} was expected; "
                         "is it the right file (images vs labels) and not corrupted?")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise UsageError(f"{path} ends inside its IDX header; re-download it")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = int(np.prod(dims)) if dims else 0
    if len(data) - header != expected:
        raise UsageError(f"{path} holds {len(data) - header} data bytes but its header promises "
                         f"{expected} ({'x'.join(map(str, dims))}); the file is truncated or corrupted")
    return np.frombuffer(data, np.uint8, offset=header).reshape(dims)


def _idx_pair(images: Path, labels: Path, classes: int | None) -> tuple[np.ndarray, np.ndarray]:
    x = read_idx(images, IDX_IMAGES_MAGIC)
    y = read_idx(labels, IDX_LABELS_MAGIC)
    if x.shape[0] != y.shape[0]:
        raise UsageError(f"{images.name} has {x.shape[0]} images but {labels.name} has {y.shape[0]} labels; "
                         "they must come from the same release")
    return pixels(x), class_labels(y, str(labels), len(y), classes)


def load_idx_dir(directory: Path, name: str) -> Dataset:
    paths = {k: directory / v for k, v in IDX_FILES.items()}
    classes = KNOWN_CLASSES.get(name)
    x_train, y_train = _idx_pair(paths["train_images"], paths["train_labels"], classes)
    x_test, y_test = _idx_pair(paths["test_images"], paths["test_labels"], classes)
    if x_train.shape[1] != x_test.shape[1]:
        raise UsageError(f"train images have {x_train.shape[1]} pixels but test images {x_test.shape[1]}; "
                         f"{directory} mixes two datasets")
    n_classes = int(max(y_train.max(initial=0), y_test.max(initial=0))) + 1
    return Dataset(name, x_train, y_train, x_test, y_test, classes or max(n_classes, 10))


def load_mnist_like(name: str, data_dir: str | None) -> Dataset:
    if data_dir is not None:
        directory = Path(data_dir)
        if not directory.is_dir():
            raise UsageError(f"--data-dir {data_dir} does not exist; create it, or point it at the folder with "
                             f"the four IDX .gz files ({', '.join(IDX_FILES.values())})")
        present = [f for f in IDX_FILES.values() if (directory / f).is_file()]
        if len(present) == len(IDX_FILES):
            return load_idx_dir(directory, name)
        if present:
            missing = [f for f in IDX_FILES.values() if f not in present]
            raise UsageError(f"{data_dir} holds only some IDX files; missing: {', '.join(missing)}")
    return load_tfds(name, data_dir)


# --- tensorflow-datasets -----------------------------------------------------------------------

def _online(host: tuple[str, int] = TFDS_DOWNLOAD_HOST, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(host, timeout=timeout):
            return True
    except OSError:
        return False


def _tfds_keys(name: str, source) -> tuple[str, str, int]:
    """(image feature, label feature, number of classes) from the dataset's own info."""
    import tensorflow_datasets as tfds

    features = source.dataset_info.features
    images = [k for k, f in features.items() if isinstance(f, tfds.features.Image)]
    labels = [k for k, f in features.items() if isinstance(f, tfds.features.ClassLabel)]
    if not images or not labels:
        raise UsageError(f"tfds:{name} has no image and class-label features ({', '.join(features.keys())}); "
                         f"mpitrain trains image classifiers: pick an image-classification dataset")
    image = "image" if "image" in images else images[0]
    label = "label" if "label" in labels else labels[0]
    return image, label, int(features[label].num_classes)


def _tfds_arrays(source, name: str, split: str, image: str, label: str, classes: int) -> tuple[np.ndarray, np.ndarray]:
    items = [source[i] for i in range(len(source))]  # one by one: mock_data's batch access is broken
    where = f"tfds:{name} split {split!r}"
    x = scaled_features(np.stack([np.asarray(ex[image]) for ex in items]) if items else np.zeros((0, 0)), where)
    y = class_labels(np.asarray([int(ex[label]) for ex in items], np.int64), where, len(items), classes)
    return x, y


def load_tfds(name: str, data_dir: str | None, splits: tuple[str, str] = ("train", "test")) -> Dataset:
    """Random-access tfds source (no TensorFlow needed). Prepared data is used as it is;
    otherwise download only when the download host answers, so offline fails in seconds."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise UsageError(f"--dataset {name} without IDX files needs tensorflow-datasets ({e}); "
                         f"pip install 'mpitrain[tfds]', or put the four IDX .gz files in --data-dir") from None
    kwargs = {"data_dir": data_dir} if data_dir else {}
    where = data_dir or os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")
    if name not in KNOWN_CLASSES and not _tfds_knows(tfds, name):
        raise UsageError(f"tensorflow-datasets has no dataset {name!r}; names are listed at "
                         f"https://www.tensorflow.org/datasets/catalog (e.g. tfds:kmnist, tfds:cifar10)")
    try:
        with _absl_quiet():
            train = tfds.data_source(name, split=splits[0], download=False, **kwargs)
            test = tfds.data_source(name, split=splits[1], download=False, **kwargs)
    except Exception:
        if not _online():
            idx = "put the four IDX .gz files in a folder and pass --data-dir DIR, or " if name in KNOWN_CLASSES else ""
            raise UsageError(f"{name} is not prepared in {where} and this machine is offline; {idx}prepare it "
                             f"with tfds where there is network and pass its data dir with --data-dir") from None
        try:
            builder_kwargs = {"file_format": "array_record"}
            train = tfds.data_source(name, split=splits[0], builder_kwargs=builder_kwargs, **kwargs)
            test = tfds.data_source(name, split=splits[1], builder_kwargs=builder_kwargs, **kwargs)
        except Exception as e:
            raise UsageError(f"could not download/prepare {name} with tfds into {where}: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    image, label, classes = _tfds_keys(name, train)
    x_train, y_train = _tfds_arrays(train, name, splits[0], image, label, classes)
    x_test, y_test = _tfds_arrays(test, name, splits[1], image, label, classes)
    return Dataset(name if name in KNOWN_CLASSES else f"{TFDS_PREFIX}{name}", x_train, y_train, x_test, y_test, classes)


@contextlib.contextmanager
def _absl_quiet():
    """tfds warns through absl ("Variant folder ... has no dataset_info.json") while it looks for
    prepared data, once per rank, before mpitrain's own one line says what is missing and the fix:
    only errors get through while it looks."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _tfds_knows(tfds, name: str) -> bool:
    """Whether tfds has a builder by that name (a config after '/', a version after ':')."""
    try:
        tfds.builder_cls(name.split("/")[0].split(":")[0])
        return True
    except Exception:
        return False


# --- sharding ---------------------------------------------------------------------------------

def steps_per_epoch(n_train: int, workers: int, batch: int) -> int:
    """Minibatches each worker takes per epoch. Equal for every worker (sync mode needs that):
    the shard of the smallest worker, in whole batches."""
    return (n_train // workers) // batch


# Whole batches only: what is left of a worker's shard each epoch waits for a later epoch's reshuffle.
# From this share of the shard on, the start lines say so (digits with 16 workers and batch 50: 39 of 89).
SHARD_LEFT_WARNING = 0.25


def shard_left_note(n_train: int, workers: int, batch: int) -> str | None:
    """A warning line when --batch-size leaves SHARD_LEFT_WARNING or more of each worker's shard
    out of every epoch (--epochs then sees fewer samples than it says), with a batch size that
    takes one more batch of it; None otherwise."""
    per_worker, spe = n_train // workers, steps_per_epoch(n_train, workers, batch)
    left = per_worker - spe * batch
    if spe < 1 or left < SHARD_LEFT_WARNING * per_worker:
        return None
    better = per_worker // (spe + 1)
    return (f"mpitrain: warning: --batch-size {batch} takes {spe} batch(es) from each worker's {per_worker} "
            f"examples per epoch, so {left} of them ({left / per_worker:.0%}) wait for a later epoch each time; "
            f"--batch-size {better} takes {spe + 1} ({(spe + 1) * better})")


def check_batch_fits(n_train: int, workers: int, batch: int) -> None:
    if steps_per_epoch(n_train, workers, batch) < 1:
        raise UsageError(f"--batch-size {batch} is larger than each worker's shard ({n_train // workers} of "
                         f"{n_train} training examples over {workers} worker(s)); use --batch-size "
                         f"{max(1, n_train // workers)} or less")


def epoch_batches(n_train: int, workers: int, worker: int, batch: int, epoch: int, seed: int) -> np.ndarray:
    """Indices of this worker's minibatches for one epoch, shape (steps_per_epoch, batch): its shard of
    the epoch's deal (core/ledger.Deal), as torch's DistributedSampler cuts one permutation per epoch."""
    return Deal(n_train, batch, workers, seed).shard_rows(epoch, worker)
