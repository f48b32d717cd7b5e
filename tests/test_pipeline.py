"""Tests of cpt_jax.data.pipeline: the Grain input pipeline (order, sharding, augmentation, resume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cpt_jax.data import pipeline as G


def _source(n: int, size: int = 4, channels: int = 1) -> list[dict]:
    """Example i: an image filled with i (mod 256), label i (so rows identify examples)."""
    return [{"image": np.full((size, size, channels), i % 256, np.uint8), "label": i,
             "id": str(i)} for i in range(n)]


def _labels(ds, num_batches: int) -> list[list[int]]:
    return [ds[t]["label"].tolist() for t in range(num_batches)]


def test_every_epoch_is_a_permutation_reshuffled_per_epoch():
    n, b = 12, 4
    ds = G.train_dataset(_source(n), global_batch_size=b, seed=3, transforms=[G.ImageLabel()],
                         process_index=0, process_count=1)
    order = sum(_labels(ds, 3 * n // b), [])
    epochs = [order[i * n:(i + 1) * n] for i in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    other_seed = G.train_dataset(_source(n), global_batch_size=b, seed=4,
                                 transforms=[G.ImageLabel()], process_index=0, process_count=1)
    assert sum(_labels(other_seed, n // b), []) != epochs[0]


@pytest.mark.parametrize("count", [2, 4])
def test_process_shards_are_disjoint_and_concatenate_to_the_global_batch(count):
    source, b = _source(40), 8
    whole = G.train_dataset(source, global_batch_size=b, seed=0,
                            transforms=[G.ImageLabel(), G.PadCropFlip(pad=1)],
                            process_index=0, process_count=1)
    shards = [G.train_dataset(source, global_batch_size=b, seed=0,
                              transforms=[G.ImageLabel(), G.PadCropFlip(pad=1)],
                              process_index=p, process_count=count) for p in range(count)]
    for t in range(7):  # crosses the epoch boundary (5 batches per epoch)
        parts = [s[t] for s in shards]
        labels = [p["label"].tolist() for p in parts]
        assert all(len(x) == b // count for x in labels)
        assert len(set(sum(labels, []))) == b  # disjoint
        np.testing.assert_array_equal(np.concatenate([p["label"] for p in parts]),
                                      whole[t]["label"])
        np.testing.assert_array_equal(np.concatenate([p["image"] for p in parts]),
                                      whole[t]["image"])  # same augmentation too


def test_bad_sharding_arguments():
    with pytest.raises(ValueError, match="multiple of the 3 processes"):
        G.train_dataset(_source(8), global_batch_size=4, seed=0, transforms=[],
                        process_index=0, process_count=3)
    with pytest.raises(ValueError, match="process_index"):
        G.train_dataset(_source(8), global_batch_size=4, seed=0, transforms=[],
                        process_index=2, process_count=2)


def _all_crops(image: np.ndarray, pad: int) -> list[np.ndarray]:
    h, w = image.shape[:2]
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    crops = [padded[y:y + h, x:x + w] for y in range(2 * pad + 1) for x in range(2 * pad + 1)]
    return crops + [c[:, ::-1] for c in crops]


def test_pad_crop_flip_is_a_crop_of_the_padded_image_and_varies():
    rng = np.random.default_rng(0)
    image = rng.integers(1, 255, (8, 8, 3), dtype=np.uint8)
    outs = [G.PadCropFlip(pad=2).random_map({"image": image, "label": 0},
                                            np.random.default_rng(s))["image"] for s in range(40)]
    candidates = _all_crops(image, 2)
    for out in outs:
        assert out.shape == image.shape and out.dtype == np.uint8
        assert any(np.array_equal(out, c) for c in candidates)
    assert len({o.tobytes() for o in outs}) > 10
    flipped = sum(any(np.array_equal(o, c[:, ::-1]) for c in candidates[:25]) for o in outs)
    assert 5 < flipped < 35  # about half


def test_random_map_is_a_function_of_seed_and_index():
    src = _source(6, size=6)
    make = lambda seed: G.train_dataset(src, global_batch_size=2, seed=seed,  # noqa: E731
                                        transforms=[G.ImageLabel(), G.PadCropFlip(pad=2)],
                                        process_index=0, process_count=1)
    a, b, c = make(1), make(1), make(2)
    np.testing.assert_array_equal(a[2]["image"], b[2]["image"])
    assert any(not np.array_equal(a[t]["image"], c[t]["image"]) for t in range(3))


def test_resize_center_crop_takes_the_centre():
    image = np.arange(256 * 300 * 1, dtype=np.int64).reshape(256, 300, 1) % 251
    image = image.astype(np.uint8)
    out = G.ResizeCenterCrop(size=224).map({"image": image, "label": 0})["image"]
    # shorter side already 256 = 224 / 0.875: no resize, the central 224 x 224 crop
    np.testing.assert_array_equal(out, image[16:240, 38:262])


def test_random_resized_crop_shape_range_and_fallback():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (37, 53, 3), dtype=np.uint8)
    t = G.RandomResizedCrop(size=24)
    for seed in range(10):
        out = t.random_map({"image": image, "label": 0}, np.random.default_rng(seed))["image"]
        assert out.shape == (24, 24, 3) and out.dtype == np.uint8
    # impossible area -> the central crop of the clipped ratio (4/3 of the height)
    y, x, h, w = G.RandomResizedCrop(size=8, area=(2.0, 3.0))._window(30, 90, rng)
    assert (h, w) == (30, 40) and (y, x) == (0, 25)


def test_device_iterator_resumes_exactly():
    ds = G.train_dataset(_source(20, size=4), global_batch_size=4, seed=5,
                         transforms=[G.ImageLabel(), G.PadCropFlip(pad=1)],
                         process_index=0, process_count=1)
    it = G.DeviceIterator(ds, mean=[0.5], std=[0.25], pixel_max=255.0, prefetch=3)
    straight = [next(it) for _ in range(9)]
    first = G.DeviceIterator(ds, mean=[0.5], std=[0.25], prefetch=3)
    for _ in range(4):
        next(first)
    state = first.get_state()
    assert state == {"next_index": 4}
    resumed = G.DeviceIterator(ds, mean=[0.5], std=[0.25], prefetch=2)
    resumed.set_state(state)
    for want in straight[4:]:
        got = next(resumed)
        np.testing.assert_array_equal(np.asarray(got["inputs"]), np.asarray(want["inputs"]))
        np.testing.assert_array_equal(np.asarray(got["labels"]), np.asarray(want["labels"]))
    # normalization on the device: (x / 255 - 0.5) / 0.25 of the host batch
    host = ds[0]["image"].astype(np.float32)
    np.testing.assert_allclose(np.asarray(straight[0]["inputs"]), (host / 255 - 0.5) / 0.25,
                               rtol=1e-6)


def test_eval_batches_cover_the_split_in_order():
    src = _source(7)
    got = list(G.eval_batches_from_source(src, 3, [G.ImageLabel()]))
    assert [int(m.sum()) for _, _, m in got] == [3, 3, 1]
    labels = np.concatenate([y[m] for _, y, m in got])
    assert labels.tolist() == list(range(7))
    assert got[-1][0].shape == (3, 4, 4, 1) and not got[-1][0][1:].any()


def test_tfds_data_source_feeds_the_pipeline():
    tfds = pytest.importorskip("tensorflow_datasets")
    from cpt_jax.data.sources import tfds_data_source

    with tfds.testing.mock_data(num_examples=10):
        source = tfds_data_source("imagenet2012", "train")
        ds = G.train_dataset(source, global_batch_size=4, seed=0,
                             transforms=[G.ImageLabel(), G.RandomResizedCrop(size=16)],
                             process_index=0, process_count=1)
        batch = ds[0]
        labels = {int(source[i]["label"]) for i in range(len(source))}
    assert batch["image"].shape == (4, 16, 16, 3) and batch["image"].dtype == np.uint8
    assert set(batch["label"].tolist()) <= labels


@pytest.mark.multiprocess
def test_two_processes_stream_disjoint_rows_of_the_one_process_batch():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "multiprocess_check.py"),
                           "--grain", "--steps=2"], env=env, cwd=root, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["grain_rows_disjoint"] and result["grain_rows_in_process_order"]
    assert result["grain_global_batch_ids_equal"]
    assert result["grain_global_inputs_max_abs_diff"] < 1e-3
    assert abs(result["grain_runner_multi_test_loss"]
               - result["grain_runner_single_test_loss"]) < 1e-4
