"""The input pipeline: exact epochs, exact resume, every test image counted once.

The batching logic is checked on tiny in-memory arrays (no TensorFlow); the
MNIST tests read the real prepared data from TFDS_DATA_DIR, once per module.
"""

import itertools
import math
import os
import shutil
import socket
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from minishard.run import data

_TFDS_DIR = os.environ.get("TFDS_DATA_DIR", "")
needs_mnist = pytest.mark.skipif(
    not os.path.isdir(os.path.join(_TFDS_DIR, "mnist")),
    reason="needs MNIST prepared by tfds: set TFDS_DATA_DIR to a directory holding mnist/ (make test does)",
)


def tiny(n: int = 10, batch_size: int = 4, **options) -> data.Dataset:
    """n examples whose pixels all equal their index, so a batch shows which rows it holds."""
    images = np.broadcast_to(np.arange(n, dtype=np.uint8)[:, None, None, None], (n, 2, 2, 1))
    return data.Dataset(images, np.arange(n), batch_size, **options)


# -- batching, on tiny arrays ----------------------------------------------------
def test_eval_pads_the_last_batch_and_masks_the_padding():
    batches = list(tiny(shuffle=False).epoch(0))
    assert [b["mask"].tolist() for b in batches][-1] == [1.0, 1.0, 0.0, 0.0]
    real = np.concatenate([b["label"][b["mask"] == 1] for b in batches])
    np.testing.assert_array_equal(real, np.arange(10))  # each example exactly once


def test_each_process_gets_its_contiguous_rows_of_every_global_batch():
    whole = list(tiny(16, 8, process_index=0, process_count=1).epoch(3))
    parts = [list(tiny(16, 8, process_index=p, process_count=2).epoch(3)) for p in (0, 1)]
    for full, first, second in zip(whole, *parts):
        np.testing.assert_array_equal(np.concatenate([first["label"], second["label"]]), full["label"])
    with pytest.raises(ValueError, match="multiple of 3 processes"):
        tiny(16, 8, process_index=0, process_count=3)


def test_to_global_shards_the_batch_axis_over_the_data_axis():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    batch = next(tiny(32, 16, shuffle=False).epoch(0))
    placed = data.to_global(batch, sharding)
    for key, value in batch.items():
        assert isinstance(placed[key], jax.Array) and placed[key].sharding == sharding
        assert placed[key].addressable_shards[0].data.shape[0] == 2  # 16 rows / 8 devices
        np.testing.assert_array_equal(np.asarray(placed[key]), value)


# -- real MNIST ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def mnist_train() -> data.Dataset:
    return data.mnist("train", 128, download=False)


@pytest.fixture(scope="module")
def mnist_test() -> data.Dataset:
    return data.mnist("test", 128, download=False)


@needs_mnist
def test_test_split_counts_every_image_exactly_once(mnist_test):
    batches = list(mnist_test.epoch(0))
    assert len(batches) == mnist_test.steps_per_epoch == math.ceil(10_000 / 128) == 79
    assert all(b["image"].shape == (128, 784) for b in batches)  # padded: one shape, one compile
    assert sum(b["mask"].sum() for b in batches) == 10_000
    real = np.concatenate([b["image"][b["mask"] == 1] for b in batches])
    # Oracle: the split read straight from TFDS, in file order.
    import tensorflow_datasets as tfds

    split = tfds.load("mnist", split="test", as_supervised=True, batch_size=-1, data_dir=_TFDS_DIR)
    images, _ = tfds.as_numpy(split)
    np.testing.assert_array_equal(real, images.reshape(10_000, 784) / np.float32(255))
    labels = np.concatenate([b["label"][b["mask"] == 1] for b in batches])
    assert np.bincount(labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@needs_mnist
def test_train_split_drops_the_partial_batch(mnist_train):
    batches = list(mnist_train.epoch(0))
    assert len(batches) == 60_000 // 128 == 468
    assert all(b["mask"].tolist() == [1.0] * 128 for b in batches)
    assert sorted(mnist_train.order(0).tolist()) == list(range(60_000))  # a permutation


@needs_mnist
def test_pixels_are_float32_in_unit_range_with_both_layouts(mnist_test):
    batch = next(mnist_test.epoch(0))
    image, label = batch["image"], batch["label"]
    assert image.dtype == np.float32 and image.shape == (128, 784)
    assert image.min() == 0.0 and image.max() == 1.0
    assert label.dtype == np.int32 and set(label.tolist()) <= set(range(10))
    assert data.DATASET_INFO["mnist"].num_features == 784
    square = next(data.mnist("test", 32, flatten=False, download=False).epoch(0))["image"]
    assert square.shape == (32, 28, 28, 1) and square.dtype == np.float32


@needs_mnist
def test_epoch_order_is_a_pure_function_of_seed_and_epoch(mnist_train):
    def first_labels(ds, epoch):
        return next(ds.epoch(epoch))["label"].tolist()

    # A new object with the same seed is what a resumed process builds.
    again = data.Dataset(mnist_train.images, mnist_train.labels, 128, shuffle_seed=0)
    other_seed = data.Dataset(mnist_train.images, mnist_train.labels, 128, shuffle_seed=1)
    assert first_labels(mnist_train, 5) == first_labels(again, 5)
    assert first_labels(mnist_train, 5) != first_labels(mnist_train, 6)
    assert first_labels(mnist_train, 5) != first_labels(other_seed, 5)


@needs_mnist
def test_start_batch_resumes_exactly_where_skipping_would(mnist_train):
    k = 100
    skipped = list(itertools.islice(mnist_train.epoch(2), k, k + 3))
    resumed = list(itertools.islice(mnist_train.epoch(2, start_batch=k), 3))
    for a, b in zip(skipped, resumed, strict=True):
        for key in ("image", "label", "mask"):
            np.testing.assert_array_equal(a[key], b[key])
    assert len(list(mnist_train.epoch(2, start_batch=k))) == 468 - k
    assert list(mnist_train.epoch(2, start_batch=468)) == []
    with pytest.raises(ValueError, match="start_batch"):
        mnist_train.epoch(2, start_batch=469)


# -- errors and the second dataset ------------------------------------------------------
def test_missing_data_is_one_clear_error(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    with pytest.raises(data.DataError) as caught:
        data.mnist("train", 128, data_dir=str(tmp_path), download=False)
    message = str(caught.value)
    assert str(tmp_path) in message and "--data-dir" in message and "TFDS_DATA_DIR" in message
    assert caught.value.__suppress_context__  # `from None`: no TensorFlow traceback
    assert list(tmp_path.iterdir()) == []  # download=False wrote (and fetched) nothing


@pytest.mark.parametrize("stage", ["load", "read"])
def test_ctrl_c_while_the_data_loads_is_passed_on_untouched(tmp_path, monkeypatch, stage):
    # The CLI's handler turns it into one line and exit 130; a DataError here would hide it.
    pytest.importorskip("tensorflow_datasets")
    _, tfds = data._tensorflow()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tfds, "load" if stage == "load" else "as_numpy", interrupted)
    if stage == "read":  # load succeeds on a tiny stand-in dataset; reading it is interrupted
        tf = data._tensorflow()[0]
        fake = tf.data.Dataset.from_tensor_slices((np.zeros((2, 28, 28, 1), np.uint8), np.zeros(2, np.int64)))
        monkeypatch.setattr(tfds, "load", lambda *args, **kwargs: fake)
    with pytest.raises(KeyboardInterrupt):
        data.mnist("test", 128, data_dir=str(tmp_path), download=False)


@needs_mnist
def test_a_truncated_data_file_is_named_with_how_to_re_prepare_it(tmp_path):
    shutil.copytree(os.path.join(_TFDS_DIR, "mnist"), tmp_path / "mnist")
    record = tmp_path / "mnist" / "3.0.1" / "mnist-test.tfrecord-00000-of-00001"
    record.write_bytes(record.read_bytes()[: record.stat().st_size // 2])
    with pytest.raises(data.DataError) as caught:
        data.mnist("test", 128, data_dir=str(tmp_path), download=False)
    message = str(caught.value)
    assert f"'mnist' split 'test' in {tmp_path} cannot be read" in message and record.name in message
    assert f"Re-prepare it: delete {tmp_path / 'mnist'}" in message


@pytest.mark.slow
def test_a_download_into_an_empty_directory_reaches_the_network(tmp_path, monkeypatch):
    # tensorflow-datasets imports importlib_resources on this path without declaring it; minishard's
    # `data` extra does. The network itself is blocked here, so the only failure left is the network.
    pytest.importorskip("tensorflow_datasets")

    def no_network(*args, **kwargs):
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # tfds retries with backoff
    with pytest.raises(data.DataError) as caught:
        data.mnist("test", 128, data_dir=str(tmp_path), download=True)
    message = str(caught.value)
    assert "downloading it failed" in message and "network blocked by the test" in message
    assert "No module named" not in message


def test_cats_vs_dogs_resizes_any_photo_to_200x200(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    # mock_data replaces reading with random examples of the dataset's own
    # features: JPEG photos of random sizes, labels 0 (cat) or 1 (dog).
    with tfds.testing.mock_data(num_examples=6):
        train = data.cats_vs_dogs("train", 4, data_dir=str(tmp_path))
        test = data.cats_vs_dogs("test", 4, data_dir=str(tmp_path), flatten=False)
    (batch,) = train.epoch(0)  # 6 examples, batch 4: the partial batch is dropped
    assert batch["image"].shape == (4, data.DATASET_INFO["cats_vs_dogs"].num_features) == (4, 120_000)
    assert batch["image"].dtype == np.float32
    assert batch["image"].min() >= 0.0 and batch["image"].max() <= 1.0
    assert set(batch["label"].tolist()) <= {0, 1}
    batches = list(test.epoch(0))
    assert batches[0]["image"].shape == (4, 200, 200, 3)
    assert sum(b["mask"].sum() for b in batches) == 6


def test_registry_names_a_loader_and_its_shapes_for_each_dataset():
    assert data.DATASETS.keys() == data.DATASET_INFO.keys() == {"mnist", "cats_vs_dogs"}
    assert data.DATASET_INFO["mnist"].num_classes == 10


def test_images_and_labels_must_match_in_length():
    with pytest.raises(ValueError, match="10 images but 9 labels"):
        data.Dataset(np.zeros((10, 2, 2, 1), np.uint8), np.zeros(9), batch_size=2)
