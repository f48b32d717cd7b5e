"""Tests of cpt_jax.data.image: loading (digits, local files, TFDS fallback) and batching."""

from __future__ import annotations

import functools
import gzip
import os
import pickle
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpt_jax import data as D

SHARED = Path(os.environ.get("CPT_JAX_DATASETS",
                             Path(__file__).resolve().parents[2] / "shared" / "datasets"))
CIFAR10_DIR = SHARED / "cifar10"
MNIST_DIR = SHARED / "mnist"


# ----------------------------------------------------------------------------- helpers


def _write_idx(path: Path, array: np.ndarray, *, magic: int | None = None,
               gz: bool = True) -> None:
    array = np.asarray(array, np.uint8)
    if magic is None:
        magic = 0x0800 + array.ndim
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    raw = header + array.tobytes()
    if gz:
        path.write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


def _write_mnist(root: Path, n_train: int = 12, n_test: int = 6, gz: bool = True) -> None:
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}",
                   rng.integers(0, 256, (n, 28, 28)), gz=gz)
        _write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", np.arange(n) % 10, gz=gz)


def _write_cifar10_npz(root: Path, n: int = 4) -> None:
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        np.savez_compressed(root / f"{name}.npz",
                            image=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
                            label=(np.arange(n) % 10).astype(np.uint8))


def _synthetic(n: int, hw: int = 8, channels: int = 1, seed: int = 0) -> D.ImageDataset:
    """A dataset whose label is the example's index: batches reveal the indices."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, hw, hw, channels), dtype=np.uint8)
    labels = np.arange(n, dtype=np.int32)
    return D.ImageDataset(train_images=images, train_labels=labels,
                          test_images=images[:3], test_labels=labels[:3],
                          mean=np.full(channels, 0.5, np.float32),
                          std=np.full(channels, 0.25, np.float32),
                          num_classes=n, name="synthetic", pixel_max=255.0)


@pytest.fixture(scope="module")
def digits() -> D.ImageDataset:
    return D.load_image_dataset("digits")


# ----------------------------------------------------------------------------- digits


def test_digits_shapes_split_and_values(digits):
    from sklearn.datasets import load_digits

    assert D.IMAGE_DATASETS[:5] == ("digits", "mnist", "fashion_mnist", "cifar10", "cifar100")
    assert set(D.IMAGE_DATASETS) == set(D.IMAGE_SPECS)
    assert digits.train_images.shape == (1497, 8, 8, 1)
    assert digits.test_images.shape == (300, 8, 8, 1)
    assert digits.train_images.dtype == np.uint8 and digits.train_labels.dtype == np.int32
    assert digits.num_classes == 10 and digits.pixel_max == 16.0 and digits.name == "digits"
    assert digits.train_images.max() == 16 and digits.train_images.min() == 0
    # Train and test are a partition of scikit-learn's 1797 images.
    ref = load_digits()
    ours = np.concatenate([digits.train_images, digits.test_images]).reshape(1797, 64)
    ours_labels = np.concatenate([digits.train_labels, digits.test_labels])
    key = lambda x, y: sorted(map(tuple, np.column_stack([x, y]).tolist()))  # noqa: E731
    assert key(ours, ours_labels) == key(ref.images.reshape(1797, 64).astype(int), ref.target)
    # Stratified: each class's test share within one example of 300 * n_c / N.
    counts = np.bincount(ref.target, minlength=10)
    test_counts = np.bincount(digits.test_labels, minlength=10)
    assert np.all(np.abs(test_counts - 300 * counts / 1797) < 1)
    # Statistics are those of train / 16.
    x = digits.train_images.astype(np.float64) / 16
    np.testing.assert_allclose(digits.mean, x.mean(axis=(0, 1, 2)), rtol=1e-6)
    np.testing.assert_allclose(digits.std, x.std(axis=(0, 1, 2)), rtol=1e-6)
    assert digits.mean.dtype == np.float32 and digits.mean.shape == (1,)


def test_digits_deterministic(digits):
    again = D.load_image_dataset("digits", splits=("train", "test"))
    for a, b in zip(jax.tree_util.tree_leaves(digits), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(a, b)
    only_test = D.load_image_dataset("digits", splits=("test",))
    np.testing.assert_array_equal(only_test.test_images, digits.test_images)
    assert only_test.train_images.shape == (0, 8, 8, 1)


def test_bad_name_and_splits():
    with pytest.raises(ValueError, match="name must be one of"):
        D.load_image_dataset("imagenet")
    with pytest.raises(ValueError, match="splits"):
        D.load_image_dataset("digits", splits=("train", "valid"))
    with pytest.raises(ValueError, match="splits"):
        D.load_image_dataset("digits", splits=())


# ----------------------------------------------------------------------------- real files


@pytest.mark.skipif(not (CIFAR10_DIR / "test_batch.npz").is_file(),
                    reason="shared CIFAR-10 copy absent")
def test_cifar10_local_npz():
    ds = D.load_image_dataset("cifar10", CIFAR10_DIR)
    assert ds.train_images.shape == (50000, 32, 32, 3) and ds.train_images.dtype == np.uint8
    assert ds.test_images.shape == (10000, 32, 32, 3)
    assert ds.train_labels.dtype == np.int32 and ds.num_classes == 10 and ds.pixel_max == 255
    np.testing.assert_array_equal(np.bincount(ds.train_labels), np.full(10, 5000))
    np.testing.assert_array_equal(np.bincount(ds.test_labels), np.full(10, 1000))
    np.testing.assert_allclose(ds.mean, [0.4914, 0.4822, 0.4465], atol=1e-3)
    np.testing.assert_allclose(ds.std, [0.2470, 0.2435, 0.2616], atol=1e-3)


@pytest.mark.skipif(not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file(),
                    reason="shared MNIST copy absent")
def test_mnist_test_only_and_missing_train_error():
    ds = D.load_image_dataset("mnist", MNIST_DIR, splits=("test",))
    assert ds.test_images.shape == (10000, 28, 28, 1) and ds.test_images.dtype == np.uint8
    assert ds.train_images.shape == (0, 28, 28, 1) and ds.train_labels.shape == (0,)
    np.testing.assert_array_equal(np.bincount(ds.test_labels)[:3], [980, 1135, 1032])
    np.testing.assert_allclose(ds.mean, [0.1325], atol=1e-3)  # from test: no train here
    with pytest.raises(FileNotFoundError) as err:
        D.load_image_dataset("mnist", MNIST_DIR)
    msg = str(err.value)
    assert str(MNIST_DIR / "train-images-idx3-ubyte.gz") in msg
    assert str(MNIST_DIR / "train-labels-idx1-ubyte.gz") in msg
    assert "t10k-images" not in msg.split("needed")[0]  # only the missing files named
    assert "training set is not available offline" in msg
    # The documented way to train on it: split the test set.
    small = D.split_dataset(ds, num_val=2000, seed=0, source="test")
    assert (small.num_train, small.num_test) == (8000, 2000)


@pytest.mark.skipif(not os.path.isdir(D.FASHION_MNIST_DEBIAN_DIR),
                    reason="Debian package dataset-fashion-mnist not installed")
def test_fashion_mnist_debian_package():
    ds = D.load_image_dataset("fashion_mnist")  # auto-detected folder
    assert ds.train_images.shape == (60000, 28, 28, 1)
    assert ds.test_images.shape == (10000, 28, 28, 1)
    np.testing.assert_array_equal(np.bincount(ds.train_labels), np.full(10, 6000))
    np.testing.assert_allclose(ds.mean, [0.2860], atol=1e-3)
    np.testing.assert_allclose(ds.std, [0.3530], atol=1e-3)
    explicit = D.load_image_dataset("fashion_mnist", D.FASHION_MNIST_DEBIAN_DIR,
                                    splits=("test",))
    np.testing.assert_array_equal(explicit.test_images, ds.test_images)


# ----------------------------------------------------------------------------- local layouts


def test_idx_gz_and_raw_and_subfolder(tmp_path):
    _write_mnist(tmp_path, gz=True)
    a = D.load_image_dataset("fashion_mnist", tmp_path)
    assert (a.num_train, a.num_test) == (12, 6)
    raw_root = tmp_path / "raw" / "MNIST" / "raw"
    raw_root.mkdir(parents=True)
    _write_mnist(raw_root, gz=False)  # torchvision's layout, un-gzipped
    b = D.load_image_dataset("mnist", tmp_path / "raw")
    np.testing.assert_array_equal(a.train_images, b.train_images)
    np.testing.assert_array_equal(b.train_labels, np.arange(12) % 10)


def test_cifar_official_pickles(tmp_path):
    rng = np.random.default_rng(2)
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    chw = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)  # (N, C, H, W)
        chw[name] = x
        with open(root / name, "wb") as f:
            pickle.dump({b"data": x.reshape(3, 3072), b"labels": [1, 2, 9],
                         b"batch_label": b"x"}, f, protocol=2)
    ds = D.load_image_dataset("cifar10", tmp_path)
    assert ds.train_images.shape == (15, 32, 32, 3)
    np.testing.assert_array_equal(ds.train_images[:3], chw["data_batch_1"].transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(ds.test_labels, [1, 2, 9])

    root100 = tmp_path / "c100" / "cifar-100-python"
    root100.mkdir(parents=True)
    for name in ("train", "test"):
        with open(root100 / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8),
                         b"fine_labels": [0, 50, 99, 7], b"coarse_labels": [0, 1, 2, 3]}, f)
    c100 = D.load_image_dataset("cifar100", tmp_path / "c100")
    assert c100.num_classes == 100
    np.testing.assert_array_equal(c100.train_labels, [0, 50, 99, 7])


def test_pickle_with_foreign_global_is_refused(tmp_path):
    root = tmp_path / "cifar-100-python"
    root.mkdir()
    with open(root / "train", "wb") as f:
        pickle.dump({b"data": os.getcwd, b"fine_labels": [0]}, f)  # a function global
    with pytest.raises(ValueError, match="train.*not allowed"):
        D.load_image_dataset("cifar100", tmp_path, splits=("train",))


def test_cifar100_npz_label_range(tmp_path):
    images = np.zeros((2, 32, 32, 3), np.uint8)
    np.savez(tmp_path / "train.npz", image=images, label=np.array([3, 100]))
    np.savez(tmp_path / "test.npz", image=images, label=np.array([3, 4]))
    with pytest.raises(ValueError, match=r"train\.npz.*\[3, 100\].*\[0, 99\]"):
        D.load_image_dataset("cifar100", tmp_path)
    assert D.load_image_dataset("cifar100", tmp_path, splits=("test",)).num_test == 2


# ----------------------------------------------------------------------------- corrupt files


def test_truncated_npz_names_file(tmp_path):
    _write_cifar10_npz(tmp_path)
    path = tmp_path / "data_batch_2.npz"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="data_batch_2.npz.*truncated or corrupt.*'image'"):
        D.load_image_dataset("cifar10", tmp_path)
    # The test split alone does not touch the broken file.
    assert D.load_image_dataset("cifar10", tmp_path, splits=("test",)).num_test == 4


def test_npz_wrong_keys_and_shape(tmp_path):
    _write_cifar10_npz(tmp_path)
    np.savez(tmp_path / "test_batch.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match=r"test_batch.npz: missing key\(s\) \['image', 'label'\]"):
        D.load_image_dataset("cifar10", tmp_path, splits=("test",))
    np.savez(tmp_path / "test_batch.npz", image=np.zeros((2, 28, 28, 3), np.uint8),
             label=np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match=r"test_batch.npz.*\(2, 28, 28, 3\).*\(N, 32, 32, 3\)"):
        D.load_image_dataset("cifar10", tmp_path, splits=("test",))


def test_idx_wrong_magic_and_truncation(tmp_path):
    _write_mnist(tmp_path)
    bad = tmp_path / "t10k-labels-idx1-ubyte.gz"
    _write_idx(bad, np.arange(6) % 10, magic=2051)
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte.gz: IDX magic number 2051.*"
                                         r"expected 2049"):
        D.load_image_dataset("mnist", tmp_path, splits=("test",))
    _write_mnist(tmp_path)
    images = tmp_path / "train-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:-40])  # cut the gzip stream
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz.*truncated or corrupt"):
        D.load_image_dataset("mnist", tmp_path)
    _write_mnist(tmp_path)
    raw = gzip.decompress(images.read_bytes())
    images.write_bytes(gzip.compress(raw[:-100]))  # valid gzip, short payload
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: \d+ bytes.*expected"):
        D.load_image_dataset("mnist", tmp_path)


def test_missing_batch_and_allow_partial(tmp_path):
    _write_cifar10_npz(tmp_path)
    (tmp_path / "data_batch_3.npz").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3.npz") as err:
        D.load_image_dataset("cifar10", tmp_path)
    assert "data_batch_1.npz, " not in str(err.value).split("needed")[0]
    with pytest.warns(UserWarning, match="4 of 5"):
        ds = D.load_image_dataset("cifar10", tmp_path, allow_partial=True)
    assert ds.num_train == 16


# ----------------------------------------------------------------------------- TFDS path


def _fake_tfds(monkeypatch, load, *, tensorflow: bool):
    """A stand-in tensorflow_datasets whose data_source finds no prepared directory."""
    def data_source(name, **kwargs):
        raise FileNotFoundError(f"no prepared {name} here")

    module = types.ModuleType("tensorflow_datasets")
    module.load = load
    module.data_source = data_source
    module.as_numpy = lambda x: x
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", module)
    monkeypatch.setitem(sys.modules, "tensorflow",
                        types.ModuleType("tensorflow") if tensorflow else None)


def test_tfds_failure_names_the_three_options(monkeypatch, tmp_path):
    calls = []
    _fake_tfds(monkeypatch, lambda *a, **k: calls.append(a), tensorflow=False)
    with pytest.raises(D.DatasetUnavailableError) as err:
        D.load_image_dataset("cifar10", tmp_path)
    msg = str(err.value)
    assert calls == []  # no TensorFlow: tfds.load is not even tried
    assert "data_batch_1.npz" in msg and "test_batch.npz" in msg and "cifar-10-batches-py" in msg
    assert "no prepared cifar10 here" in msg and "tfds build cifar10" in msg
    assert "needs TensorFlow" in msg and str(tmp_path) in msg
    assert isinstance(err.value, FileNotFoundError)


def test_tfds_load_failure_is_reported_when_tensorflow_imports(monkeypatch, tmp_path):
    def load(*args, **kwargs):
        raise ConnectionError("no internet")

    _fake_tfds(monkeypatch, load, tensorflow=True)
    with pytest.raises(D.DatasetUnavailableError, match="no internet"):
        D.load_image_dataset("cifar10", tmp_path)


def test_tfds_load_path_with_tensorflow(monkeypatch, tmp_path):
    calls = []

    def load(name, *, split, batch_size, data_dir):
        calls.append((name, split, batch_size, data_dir))
        n = 5 if split == "train" else 3
        return {"image": np.full((n, 28, 28, 1), 7, np.uint8),
                "label": np.arange(n, dtype=np.int64)}

    _fake_tfds(monkeypatch, load, tensorflow=True)
    ds = D.load_image_dataset("mnist", tmp_path)  # empty folder: no local files
    assert calls == [("mnist", "train", -1, str(tmp_path)), ("mnist", "test", -1, str(tmp_path))]
    assert ds.train_images.shape == (5, 28, 28, 1) and ds.train_labels.dtype == np.int32
    np.testing.assert_allclose(ds.mean, [7 / 255], rtol=1e-6)


@pytest.mark.parametrize("name,shape", [("cifar10", (32, 32, 3)), ("kmnist", (28, 28, 1))])
def test_tfds_data_source_path_without_tensorflow(monkeypatch, tmp_path, name, shape):
    tfds = pytest.importorskip("tensorflow_datasets")
    def no_load(*args, **kwargs):
        raise AssertionError("tfds.load must not be needed for a prepared directory")

    monkeypatch.setattr(tfds, "load", no_load)
    with tfds.testing.mock_data(num_examples=7):
        ds = D.load_image_dataset(name, tmp_path)
        source = tfds.data_source(name, split="test", download=False)
        want = np.stack([np.asarray(source[i]["image"]) for i in range(len(source))])
        want_labels = [int(source[i]["label"]) for i in range(len(source))]
    assert ds.train_images.shape == (7,) + shape and ds.test_images.shape == (7,) + shape
    np.testing.assert_array_equal(ds.test_images, want.reshape((7,) + shape))
    assert ds.test_labels.tolist() == want_labels
    expected_mean = ds.train_images.reshape(-1, shape[-1]).mean(0) / 255
    np.testing.assert_allclose(ds.mean, expected_mean, rtol=1e-5)


def test_variable_size_datasets_point_to_the_grain_pipeline():
    with pytest.raises(ValueError, match="Grain pipeline"):
        D.load_image_dataset("imagenet2012")


# ----------------------------------------------------------------------------- split


def test_split_dataset(digits):
    a = D.split_dataset(digits, num_val=200, seed=3)
    b = D.split_dataset(digits, num_val=200, seed=3)
    c = D.split_dataset(digits, num_val=200, seed=4)
    assert (a.num_train, a.num_test) == (1297, 200)
    np.testing.assert_array_equal(a.test_images, b.test_images)
    assert not np.array_equal(a.test_labels, c.test_labels)
    merged = np.concatenate([a.train_images, a.test_images]).reshape(1497, -1)
    assert sorted(map(tuple, merged.tolist())) == sorted(
        map(tuple, digits.train_images.reshape(1497, -1).tolist()))
    np.testing.assert_allclose(a.mean, a.train_images.mean() / 16, rtol=1e-5)
    with pytest.raises(ValueError, match="num_val"):
        D.split_dataset(digits, num_val=1497, seed=0)
    test_only = D.load_image_dataset("digits", splits=("test",))
    with pytest.raises(ValueError, match="source='test'"):
        D.split_dataset(test_only, num_val=10, seed=0)


# ----------------------------------------------------------------------------- batching


def test_steps_per_epoch():
    assert D.steps_per_epoch(50000, 128) == 390
    assert D.steps_per_epoch(10, 10) == 1
    with pytest.raises(ValueError, match="batch_size"):
        D.steps_per_epoch(10, 0)
    with pytest.raises(ValueError, match="n must be"):
        D.steps_per_epoch(5, 8)


def test_batch_at_step_epochs_are_permutations():
    ds = _synthetic(50)
    data = D.to_device(ds)
    key = jax.random.PRNGKey(42)
    fn = jax.jit(functools.partial(D.batch_at_step, batch_size=8, augment=False))
    spe = D.steps_per_epoch(50, 8)
    assert spe == 6
    epochs = []
    for epoch in range(3):
        labels = [np.asarray(fn(data, jnp.int32(epoch * spe + s), key)[1]) for s in range(spe)]
        idx = np.concatenate(labels)
        assert len(set(idx.tolist())) == 48  # no repeats; 2 of 50 left out this epoch
        perm = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), 50))
        np.testing.assert_array_equal(idx, perm[:48])
        epochs.append(idx)
    assert not np.array_equal(epochs[0], epochs[1])
    # Same step -> same batch, jitted (traced step) or not; images follow the labels.
    x1, y1 = fn(data, jnp.int32(7), key)
    x2, y2 = D.batch_at_step(data, 7, key, batch_size=8, augment=False)
    np.testing.assert_allclose(x1, x2, rtol=1e-6, atol=1e-6)  # XLA may fuse differently
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(x1, fn(data, jnp.int32(7), key)[0])
    expected = (ds.train_images[np.asarray(y1)] / 255.0 - 0.5) / 0.25
    np.testing.assert_allclose(x1, expected, rtol=1e-5, atol=1e-5)
    assert x1.dtype == jnp.float32 and y1.dtype == jnp.int32
    # A different key gives a different order.
    assert not np.array_equal(y1, fn(data, jnp.int32(7), jax.random.PRNGKey(0))[1])
    with pytest.raises(ValueError, match="n must be"):
        D.batch_at_step(data, 0, key, batch_size=64, augment=False)


def test_batch_at_step_digits_in_jitted_step(digits):
    data = D.to_device(digits)
    key = jax.random.PRNGKey(0)

    @jax.jit
    def train_step(step):
        x, y = D.batch_at_step(data, step, key, batch_size=64, augment=False)
        return x.sum(), y

    s1, y1 = train_step(jnp.int32(5))
    s2, y2 = train_step(jnp.int32(5))
    assert float(s1) == float(s2)
    np.testing.assert_array_equal(y1, y2)
    assert train_step._cache_size() == 1
    train_step(jnp.int32(6))
    assert train_step._cache_size() == 1  # a new step does not recompile


def _matches_shift_or_flip(out: np.ndarray, image: np.ndarray, pad: int) -> bool:
    h, w = image.shape[:2]
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            crop = padded[dy:dy + h, dx:dx + w]
            if np.array_equal(out, crop) or np.array_equal(out, crop[:, ::-1]):
                return True
    return False


def test_augment_cifar_is_shift_and_flip():
    rng = np.random.default_rng(0)
    images = rng.integers(1, 256, (16, 12, 12, 3), dtype=np.uint8)
    out = np.asarray(D.augment_cifar(jnp.asarray(images), jax.random.PRNGKey(3)))
    assert out.shape == images.shape and out.dtype == np.uint8
    for o, i in zip(out, images):
        assert _matches_shift_or_flip(o, i, 4)
    assert not np.array_equal(out, images)
    # Over many examples, several offsets and both flip states occur.
    const = np.tile(np.arange(1, 13, dtype=np.uint8)[None, None, :, None], (64, 12, 1, 1))
    outs = np.asarray(D.augment_cifar(jnp.asarray(const), jax.random.PRNGKey(5)))
    rows = {tuple(o[6, :, 0].tolist()) for o in outs}
    assert len(rows) > 8
    flipped = [o[6, 5, 0] > o[6, 6, 0] for o in outs]  # increasing ramp reversed
    assert 0 < sum(flipped) < 64


def test_batch_at_step_augment_constant_image():
    n, hw = 20, 16
    ds = D.ImageDataset(
        train_images=np.full((n, hw, hw, 3), 200, np.uint8),
        train_labels=np.arange(n, dtype=np.int32),
        test_images=np.zeros((0, hw, hw, 3), np.uint8), test_labels=np.zeros(0, np.int32),
        mean=np.array([0.2, 0.3, 0.4], np.float32), std=np.array([0.5, 0.5, 0.5], np.float32),
        num_classes=n, name="const", pixel_max=255.0)
    data = D.to_device(ds)
    key = jax.random.PRNGKey(1)
    x, y = D.batch_at_step(data, 3, key, batch_size=10, augment=True)
    _, y_plain = D.batch_at_step(data, 3, key, batch_size=10, augment=False)
    np.testing.assert_array_equal(y, y_plain)  # augmentation does not change the order
    x = np.asarray(x)
    inside = (200 / 255 - ds.mean) / ds.std
    padding = (0 - ds.mean) / ds.std  # zero padding of the raw pixels
    assert x.shape == (10, hw, hw, 3)
    np.testing.assert_allclose(x[:, 4:-4, 4:-4], np.broadcast_to(inside, x[:, 4:-4, 4:-4].shape),
                               rtol=1e-6)
    border_ok = np.isclose(x, inside, rtol=1e-6) | np.isclose(x, padding, rtol=1e-6)
    assert border_ok.all()
    assert np.isclose(x, padding).any()  # some crop is shifted
    x_again = np.asarray(D.batch_at_step(data, 3, key, batch_size=10, augment=True)[0])
    np.testing.assert_array_equal(x, x_again)


# ----------------------------------------------------------------------------- eval, normalize


def test_eval_batches(digits):
    chunks = list(D.eval_batches(digits.test_images, digits.test_labels, 128))
    assert [c[0].shape[0] for c in chunks] == [128, 128, 128]
    assert [int(c[2].sum()) for c in chunks] == [128, 128, 44]
    images = np.concatenate([c[0][c[2]] for c in chunks])
    labels = np.concatenate([c[1][c[2]] for c in chunks])
    np.testing.assert_array_equal(images, digits.test_images)
    np.testing.assert_array_equal(labels, digits.test_labels)
    assert (chunks[-1][0][44:] == 0).all()
    exact = list(D.eval_batches(digits.test_images, digits.test_labels, 128, pad_last=False))
    assert [c[0].shape[0] for c in exact] == [128, 128, 44] and all(c[2].all() for c in exact)
    data = D.to_device(digits)
    on_device = list(D.eval_batches(data.test_images, data.test_labels, 100))
    assert len(on_device) == 3 and isinstance(on_device[0][0], jax.Array)
    with pytest.raises(ValueError, match="batch_size"):
        next(D.eval_batches(digits.test_images, digits.test_labels, 0))


def test_normalize_and_to_device(digits):
    x = D.normalize(digits.test_images, digits.mean, digits.std, digits.pixel_max)
    expected = (digits.test_images / 16.0 - digits.mean) / digits.std
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-5)
    train = D.normalize(digits.train_images, digits.mean, digits.std, digits.pixel_max)
    np.testing.assert_allclose(float(train.mean()), 0.0, atol=1e-4)
    np.testing.assert_allclose(float(train.std()), 1.0, atol=1e-4)
    data = D.to_device(digits)
    assert data.train_images.dtype == jnp.uint8 and data.train_labels.dtype == jnp.int32
    assert data.pixel_max == 16.0 and data.num_classes == 10
    leaves, treedef = jax.tree_util.tree_flatten(data)
    assert len(leaves) == 6
    assert jax.tree_util.tree_unflatten(treedef, leaves).name == "digits"
