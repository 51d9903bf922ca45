"""Datasets, the IDX reader, the tfds path and sharding."""

import gzip
import time

import numpy as np
import pytest

from mpitrain.core import data
from mpitrain.core.config import UsageError
from mpitrain.core.data import IDX_FILES, epoch_batches, load_idx_dir, read_idx, steps_per_epoch


def write_idx(path, array, magic=None):
    array = np.asarray(array, np.uint8)
    magic = magic if magic is not None else (2051 if array.ndim == 3 else 2049)
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


def write_mnist_dir(directory, n_train=123, n_test=45, seed=0, side=28):
    """MNIST-format files with learnable content: each class lights up its own band of rows."""
    rng = np.random.default_rng(seed)

    def make(n):
        y = rng.integers(0, 10, n)
        x = rng.integers(0, 60, (n, side, side))
        for i, label in enumerate(y):
            rows = slice(label * side // 10, (label + 1) * side // 10)
            x[i, rows, :] = rng.integers(150, 256, (rows.stop - rows.start, side))
        return x, y

    (xtr, ytr), (xte, yte) = make(n_train), make(n_test)
    write_idx(directory / IDX_FILES["train_images"], xtr)
    write_idx(directory / IDX_FILES["train_labels"], ytr)
    write_idx(directory / IDX_FILES["test_images"], xte)
    write_idx(directory / IDX_FILES["test_labels"], yte)
    return xtr, ytr


def test_digits_is_offline_scaled_and_split_fixed():
    a, b = data.load_digits(), data.load_digits()
    assert a.x_train.shape == (1438, 64) and a.x_test.shape == (359, 64)
    assert a.x_train.dtype == np.float32 and 0 <= a.x_train.min() and a.x_train.max() <= 1
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert set(np.unique(a.y_train)) == set(range(10))


def test_idx_reader_reads_any_number_of_examples(tmp_path):
    xtr, ytr = write_mnist_dir(tmp_path, n_train=123, n_test=45)
    ds = load_idx_dir(tmp_path, "mnist")
    assert ds.x_train.shape == (123, 784) and ds.x_test.shape == (45, 784)
    np.testing.assert_allclose(ds.x_train[5], xtr[5].reshape(-1) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y_train, ytr)
    assert ds.n_classes == 10


def test_idx_reader_rejects_wrong_magic(tmp_path):
    p = tmp_path / "x.gz"
    write_idx(p, np.zeros((2, 3, 3)), magic=2049)  # a labels magic on an images file
    with pytest.raises(UsageError, match="magic number 2049 where 2051"):
        read_idx(p, 2051)


def test_idx_reader_rejects_truncated_and_non_gzip(tmp_path):
    p = tmp_path / "t.gz"
    header = (2051).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (10, 28, 28))
    with gzip.open(p, "wb") as f:
        f.write(header + bytes(100))
    with pytest.raises(UsageError, match="truncated"):
        read_idx(p, 2051)
    q = tmp_path / "plain.gz"
    q.write_bytes(b"not gzip at all")
    with pytest.raises(UsageError, match="cannot read"):
        read_idx(q, 2051)


def test_idx_label_image_count_mismatch(tmp_path):
    write_mnist_dir(tmp_path)
    write_idx(tmp_path / IDX_FILES["train_labels"], np.zeros(7))
    with pytest.raises(UsageError, match="123 images but .* 7 labels"):
        load_idx_dir(tmp_path, "mnist")


def test_partial_idx_dir_names_the_missing_files(tmp_path):
    write_mnist_dir(tmp_path)
    (tmp_path / IDX_FILES["test_labels"]).unlink()
    with pytest.raises(UsageError, match="missing: t10k-labels-idx1-ubyte.gz"):
        data.load_mnist_like("mnist", str(tmp_path))


def test_tfds_path_under_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=40):
        ds = data.load_mnist_like("fashion_mnist", None)
    assert ds.x_train.shape == (40, 784) and ds.x_test.shape[1] == 784
    assert ds.x_train.dtype == np.float32 and 0 <= ds.x_train.min() and ds.x_train.max() <= 1
    assert ds.y_train.min() >= 0 and ds.y_train.max() < 10


@pytest.mark.parametrize("name", ["mnist", "tfds:kmnist"])
def test_tfds_offline_fails_in_seconds(tmp_path, monkeypatch, name):
    pytest.importorskip("tensorflow_datasets")
    from mpitrain.core.config import TrainConfig

    monkeypatch.setattr(data, "_online", lambda *a, **k: False)
    t0 = time.perf_counter()
    with pytest.raises(UsageError, match=f"{name.split(':')[-1]} is not prepared in .* and this machine is offline"):
        data.load_dataset(TrainConfig(dataset=name, data_dir=str(tmp_path)))
    assert time.perf_counter() - t0 < 10


def test_a_half_prepared_tfds_folder_is_one_line_not_a_warning_per_rank(tmp_path, monkeypatch, caplog):
    """An empty mnist/3.0.1 (a download that never finished) made tfds warn through absl, on every
    rank ("Variant folder ... has no dataset_info.json"), before mpitrain's own line."""
    pytest.importorskip("tensorflow_datasets")
    import logging

    from mpitrain.core.config import TrainConfig

    (tmp_path / "mnist" / "3.0.1").mkdir(parents=True)
    monkeypatch.setattr(data, "_online", lambda *a, **k: False)
    with pytest.raises(UsageError, match="mnist is not prepared in"):
        data.load_dataset(TrainConfig(dataset="mnist", data_dir=str(tmp_path)))
    assert not [r for r in caplog.records if "dataset_info.json" in r.getMessage()], caplog.text
    assert logging.getLogger("absl").level == logging.NOTSET  # put back as it was


def test_online_probe_gives_up_quickly():
    t0 = time.perf_counter()
    data._online(("192.0.2.1", 9), timeout=0.5)  # TEST-NET-1: never answers
    assert time.perf_counter() - t0 < 3


def test_synthetic_is_seeded_scaled_and_sized():
    a = data.make_synthetic(600, 30, 10, seed=4)
    b = data.make_synthetic(600, 30, 10, seed=4)
    c = data.make_synthetic(600, 30, 10, seed=5)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.x_train, c.x_train)
    assert a.x_train.shape == (500, 30) and a.x_test.shape == (100, 30)
    assert 0 <= a.x_train.min() and a.x_train.max() <= 1


@pytest.mark.parametrize("n,features", [(1, 784), (data.SYNTHETIC_ROWS + 1, 784), (3 * data.SYNTHETIC_ROWS, 20),
                                        (12000, 784)])
def test_synthetic_made_in_slices_is_the_one_expression_bit_for_bit(n, features):
    """make_synthetic makes its rows a slice at a time (no float64 arrays of the set's size); every deterministic
    run's digest rests on its numbers being those of the one expression it replaced, across slice edges."""
    got = data.make_synthetic(n, features, 10, seed=3)
    rng = np.random.default_rng([3, 0x5E7])
    centres, projection = rng.normal(0.0, 1.0, (10, 16)), rng.normal(0.0, 1.0 / np.sqrt(16), (16, features))
    y = rng.integers(0, 10, size=n)
    x = np.clip((centres[y] + rng.normal(0.0, 0.8, (n, 16))) @ projection - 0.5, 0.0, 1.0).astype(np.float32)
    test = max(1, n // 6)
    assert np.array_equal(got.x_train, x[test:]) and np.array_equal(got.x_test, x[:test])
    assert np.array_equal(got.y_train, y[test:]) and got.x_train.dtype == np.float32


def test_pixels_are_scaled_as_they_were():
    """uint8 images are divided in place (one array, not two): the same float32 numbers as astype / 255.0."""
    x = np.arange(256, dtype=np.uint8).repeat(6).reshape(64, 4, 6)
    got = data.pixels(x)
    assert got.dtype == np.float32 and got.shape == (64, 24)
    assert np.array_equal(got, x.reshape(64, -1).astype(np.float32) / 255.0) and got[-1, -1] == 1.0


@pytest.mark.parametrize("n,workers,batch", [(1437, 2, 100), (1000, 3, 7), (50, 1, 50)])
def test_shards_are_disjoint_complete_and_reshuffled(n, workers, batch):
    spe = steps_per_epoch(n, workers, batch)
    e0 = [epoch_batches(n, workers, w, batch, 0, seed=1) for w in range(workers)]
    flat = np.concatenate([b.reshape(-1) for b in e0])
    assert all(b.shape == (spe, batch) for b in e0)
    assert len(np.unique(flat)) == len(flat)  # disjoint
    assert len(flat) == workers * spe * batch  # every worker gets equally many whole batches
    assert len(flat) >= n - workers * (batch + 1)  # complete but for the remainders
    e1 = epoch_batches(n, workers, 0, batch, 1, seed=1)
    assert not np.array_equal(e0[0], e1)  # reshuffled each epoch
    np.testing.assert_array_equal(e0[0], epoch_batches(n, workers, 0, batch, 0, seed=1))  # from the seed


def test_every_example_is_seen_over_epochs():
    seen = set()
    for epoch in range(20):
        for w in range(3):
            seen.update(epoch_batches(100, 3, w, 10, epoch, seed=0).reshape(-1).tolist())
    assert seen == set(range(100))


def test_batch_larger_than_shard_is_a_usage_error():
    with pytest.raises(UsageError, match="--batch-size 800 is larger"):
        data.check_batch_fits(1437, 2, 800)


# --- your own arrays: --dataset npz:PATH -------------------------------------------------------

def write_npz(path, **overrides):
    rng = np.random.default_rng(1)
    arrays = {"x_train": rng.integers(0, 256, (50, 6, 6, 3), dtype=np.uint8), "y_train": rng.integers(0, 3, 50),
              "x_test": rng.integers(0, 256, (20, 6, 6, 3), dtype=np.uint8), "y_test": rng.integers(0, 3, 20)}
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


def test_npz_images_are_flattened_scaled_and_counted(tmp_path):
    y_train = np.array([0, 1, 2, 4, 3] * 10)
    ds = data.load_npz(str(write_npz(tmp_path / "d.npz", y_train=y_train, y_test=np.array([0, 1, 2, 4] * 5))))
    assert ds.x_train.shape == (50, 108) and ds.x_train.dtype == np.float32
    assert 0 <= ds.x_train.min() and ds.x_train.max() <= 1 and ds.x_train.max() > 0.9  # uint8 / 255
    assert ds.n_classes == 5 and ds.name == "npz:d.npz" and ds.y_train.dtype == np.int64 and ds.notes == []


def test_npz_float_features_are_standardised_on_the_training_set(tmp_path):
    rng = np.random.default_rng(0)
    x_train = np.column_stack([rng.normal(1000, 50, 50), rng.normal(0.01, 0.002, 50), np.full(50, 3.0)])
    x_test = x_train[:20] + 50
    ds = data.load_npz(str(write_npz(tmp_path / "f.npz", x_train=x_train, x_test=x_test)))
    assert np.allclose(ds.x_train[:, :2].mean(axis=0), 0, atol=1e-5) and np.allclose(ds.x_train[:, :2].std(axis=0), 1)
    assert (ds.x_train[:, 2] == 0).all()  # a constant feature: centred, not divided by 0
    assert np.allclose(ds.x_test[:, 0], ds.x_train[:20, 0] + 50 / x_train[:, 0].std(), atol=1e-4)  # the train's scale


def test_npz_labels_the_model_cannot_have_are_refused_and_gaps_said(tmp_path):
    with pytest.raises(UsageError, match=r"y_test has label 7, but y_train's labels go up to 2: the model would"):
        data.load_npz(str(write_npz(tmp_path / "a.npz", y_test=np.array([0, 1, 2, 7] * 5))))
    gap = data.load_npz(str(write_npz(tmp_path / "b.npz", y_train=np.array([0, 1, 5] * 16 + [0, 1]),
                                      y_test=np.array([0, 1, 2, 2] * 5))))
    assert gap.n_classes == 6 and len(gap.notes) == 1
    assert "class 2, 3, 4 never appears in y_train (y_test has 2): the model cannot learn it" in gap.notes[0]
    column = data.load_npz(str(write_npz(tmp_path / "c.npz", y_train=np.array([[0], [1], [2], [1], [0]] * 10))))
    assert column.y_train.shape == (50,)  # a (n, 1) column of labels, as pandas gives them


def test_a_file_given_without_npz_is_pointed_to_it(tmp_path):
    from mpitrain.api import config

    path = write_npz(tmp_path / "mine.npz")
    with pytest.raises(UsageError, match=f"as in dataset='npz:{path}'"):  # the keyword the caller passed
        config(dataset=str(path))


@pytest.mark.parametrize("overrides,needle", [
    ({"y_test": None}, "has no y_test (it has: x_train, y_train, x_test)"),
    ({"x_test": np.zeros((20, 5), np.float32)}, "x_train has 108 features per example but x_test 5"),
    ({"y_train": np.zeros(50) + 0.5}, "y_train must be a 1-D array of integer class labels"),
    ({"y_train": np.array([f"class_{i % 3}" for i in range(50)])}, "np.unique(np.concatenate([y_train, y_test]), "
                                                                      "return_inverse=True)"),
    ({"y_train": np.arange(50) - 1}, "y_train has a negative label (-1)"),
    ({"y_train": np.zeros(49, np.int64)}, "y_train has 49 labels for 50 examples"),
    ({"x_train": np.full((50, 3), np.nan)}, "x_train holds NaN or infinite values"),
    ({"x_train": np.zeros((50, 3), np.int32)}, "x_train has dtype int32; features must be uint8"),
    ({"y_train": np.zeros(50, np.int64)}, "every label in y_train is 0"),
    ({"x_train": np.array([{"a": 1}] * 50, dtype=object)}, "cannot be read without pickle"),
])
def test_npz_problems_name_the_file_and_the_fix(tmp_path, overrides, needle):
    path = write_npz(tmp_path / "bad.npz", **overrides)
    with pytest.raises(UsageError) as e:
        data.load_npz(str(path))
    assert needle in str(e.value) and "bad.npz" in str(e.value)


def test_the_fix_offered_for_named_labels_works_as_written(tmp_path):
    """String labels get np.unique's numbering, which works on them (astype(np.int64) raises)."""
    y_train = np.array([f"class_{i % 3}" for i in range(50)])
    y_test = np.array([f"class_{i % 3}" for i in range(20)])
    with pytest.raises(UsageError, match="return_inverse"):
        data.load_npz(str(write_npz(tmp_path / "named.npz", y_train=y_train, y_test=y_test)))
    _, both = np.unique(np.concatenate([y_train, y_test]), return_inverse=True)  # the message's fix, as written
    fixed = write_npz(tmp_path / "fixed.npz", y_train=both[:50], y_test=both[50:])
    assert data.load_npz(str(fixed)).y_train.tolist()[:3] == [0, 1, 2]


def test_npz_that_is_not_an_archive(tmp_path):
    (tmp_path / "a.npz").write_bytes(b"not a zip")
    with pytest.raises(UsageError, match="not a readable .npz file"):
        data.load_npz(str(tmp_path / "a.npz"))
    np.save(tmp_path / "b.npy", np.zeros(3))
    with pytest.raises(UsageError, match="single .npy array"):
        data.load_npz(str(tmp_path / "b.npy"))


@pytest.mark.parametrize("damage", ["truncated", "a member's bytes changed"])
def test_a_damaged_npz_is_one_line_on_every_rank(tmp_path, damage):
    """Was: three interleaved BadZipFile tracebacks, exit 1 (a damaged member: Bad CRC-32)."""
    from conftest import own_lines, run_mpitrain

    path = write_npz(tmp_path / "mine.npz")
    raw = bytearray(path.read_bytes())
    if damage == "truncated":
        raw = raw[: len(raw) * 2 // 3]
    else:
        raw[len(raw) // 3] ^= 0xFF  # inside x_train's data: the zip's CRC no longer matches
    path.write_bytes(bytes(raw))
    proc = run_mpitrain(3, "--no-progress", "--dataset", f"npz:{path}", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [x for x in own_lines(proc.stderr) if x.strip()]
    assert len(lines) == 1 and "mine.npz is corrupt or truncated" in lines[0] and "np.savez" in lines[0], lines


def test_mnist_labels_outside_0_9_are_refused(tmp_path):
    """A label of 200 used to build a 201-class model silently."""
    write_mnist_dir(tmp_path)
    labels = np.zeros(45, np.uint8)
    labels[7] = 200
    write_idx(tmp_path / IDX_FILES["test_labels"], labels)
    with pytest.raises(UsageError, match="has label 200, but this dataset has 10 classes"):
        data.load_mnist_like("mnist", str(tmp_path))


# --- any tfds image-classification dataset: --dataset tfds:NAME ------------------------------------

@pytest.mark.parametrize("name,features,classes", [("kmnist", 784, 10), ("cifar10", 32 * 32 * 3, 10),
                                                   ("emnist/letters", 784, 37)])
def test_tfds_image_datasets_under_mock_data(name, features, classes):
    tfds = pytest.importorskip("tensorflow_datasets")
    from mpitrain.core.config import TrainConfig

    with tfds.testing.mock_data(num_examples=30):
        ds = data.load_dataset(TrainConfig(dataset=f"tfds:{name}"))
    assert ds.x_train.shape == (30, features) and ds.x_test.shape == (30, features)
    assert ds.n_classes == classes and ds.name == f"tfds:{name}"  # from the dataset's own info
    assert ds.x_train.dtype == np.float32 and 0 <= ds.x_train.min() and ds.x_train.max() <= 1
    assert 0 <= ds.y_train.min() and ds.y_train.max() < classes


def test_tfds_other_splits_and_unknown_names(monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=30):
        asked, real = [], tfds.data_source  # mock_data serves any split whole: check what is asked
        monkeypatch.setattr(tfds, "data_source", lambda name, split, **kw: asked.append(split) or real(name, split=split, **kw))
        data.load_tfds("cifar10", None, ("train[:10]", "extra"))
        assert asked == ["train[:10]", "extra"]
        with pytest.raises(UsageError, match="has no dataset 'no_such_set'"):
            data.load_tfds("no_such_set", None)



def test_a_batch_size_that_leaves_a_quarter_of_each_shard_out_of_every_epoch_is_named():
    """Digits with 16 workers and --batch-size 50: one batch of each worker's 89 examples per epoch,
    39 left for later (--epochs 50 then sees 57% of the samples 2 workers see); 44 takes two."""
    from mpitrain.core.data import shard_left_note

    note = shard_left_note(1438, 16, 50)
    assert "takes 1 batch(es) from each worker's 89 examples" in note and "39 of them (44%)" in note
    assert note.endswith("--batch-size 44 takes 2 (88)")
    assert shard_left_note(1438, 16, 44) is None and shard_left_note(1438, 3, 100) is None  # 79 of 479: 16%
