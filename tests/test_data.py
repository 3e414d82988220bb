"""The input pipeline: exact epochs, exact resume, every test image counted once.

The batching logic is checked on tiny in-memory arrays (no TensorFlow); the
MNIST tests read the real prepared data from TFDS_DATA_DIR, once per module.
"""

import dataclasses
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

from minishard.run import data, text_data, tfds_reading

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
def test_pixels_are_float32_in_unit_range_with_both_shapes(mnist_test):
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
    with pytest.raises(tfds_reading.DataError) as caught:
        data.mnist("train", 128, data_dir=str(tmp_path), download=False)
    message = str(caught.value)
    assert str(tmp_path) in message and "--data-dir" in message and "TFDS_DATA_DIR" in message
    assert caught.value.__suppress_context__  # `from None`: no TensorFlow traceback
    assert list(tmp_path.iterdir()) == []  # download=False wrote (and fetched) nothing


@pytest.mark.parametrize("stage", ["load", "read"])
def test_ctrl_c_while_the_data_loads_is_passed_on_untouched(tmp_path, monkeypatch, stage):
    # The CLI's handler turns it into one line and exit 130; a DataError here would hide it.
    pytest.importorskip("tensorflow_datasets")
    _, tfds = tfds_reading.tensorflow()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tfds, "load" if stage == "load" else "as_numpy", interrupted)
    if stage == "read":  # load succeeds on a tiny stand-in dataset; reading it is interrupted
        tf = tfds_reading.tensorflow()[0]
        fake = tf.data.Dataset.from_tensor_slices((np.zeros((2, 28, 28, 1), np.uint8), np.zeros(2, np.int64)))
        monkeypatch.setattr(tfds, "load", lambda *args, **kwargs: fake)
    with pytest.raises(KeyboardInterrupt):
        data.mnist("test", 128, data_dir=str(tmp_path), download=False)


@needs_mnist
def test_a_truncated_data_file_is_named_with_how_to_re_prepare_it(tmp_path):
    shutil.copytree(os.path.join(_TFDS_DIR, "mnist"), tmp_path / "mnist")
    record = tmp_path / "mnist" / "3.0.1" / "mnist-test.tfrecord-00000-of-00001"
    record.write_bytes(record.read_bytes()[: record.stat().st_size // 2])
    with pytest.raises(tfds_reading.DataError) as caught:
        data.mnist("test", 128, data_dir=str(tmp_path), download=False)
    message = str(caught.value)
    assert f"'mnist' split 'test' in {tmp_path} cannot be read" in message and record.name in message
    assert f"Re-prepare it: delete {tmp_path / 'mnist'}" in message
    assert caught.value.__context__ is None  # TF's error, and the tf.data pipeline it holds, are freed


DOWNLOADS = {
    "mnist": lambda directory: data.mnist("test", 128, data_dir=directory, download=True),
    "tiny_shakespeare": lambda directory: text_data.tiny_shakespeare("test", 64, 16, data_dir=directory),
}


@pytest.mark.slow
@pytest.mark.parametrize("dataset", DOWNLOADS)
def test_a_download_into_an_empty_directory_reaches_the_network(tmp_path, monkeypatch, dataset):
    # tensorflow-datasets imports importlib_resources on this path without declaring it; minishard's
    # `data` extra does. The network itself is blocked here, so the only failure left is the network.
    pytest.importorskip("tensorflow_datasets")

    def no_network(*args, **kwargs):
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # tfds retries with backoff
    with pytest.raises(tfds_reading.DataError) as caught:
        DOWNLOADS[dataset](str(tmp_path))  # download=True: tiny_shakespeare's default
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
    assert text_data.TEXT_DATASET_INFO.keys() == {"tiny_shakespeare"}  # text: its own loader, text_dataset
    assert data.DATASET_INFO["mnist"].num_classes == 10


def test_images_and_labels_must_match_in_length():
    with pytest.raises(ValueError, match="10 images but 9 labels"):
        data.Dataset(np.zeros((10, 2, 2, 1), np.uint8), np.zeros(9), batch_size=2)


def test_training_batches_are_a_pure_function_of_the_step_across_epochs():
    ds = tiny(10, 4, shuffle_seed=3)  # 2 steps per epoch (the partial batch dropped)
    steps = [b["label"].tolist() for b in ds.batches(0, 5)]
    by_epoch = [b["label"].tolist() for e in range(3) for b in ds.epoch(e)][:5]
    assert steps == by_epoch and len(steps) == 5  # step s is batch s % 2 of epoch s // 2
    assert [b["label"].tolist() for b in ds.batches(3, 5)] == steps[3:]  # resumed at step 3: the same
    assert sorted(next(ds.batches(0, 1))) == ["image", "label"]  # training never pads: no mask
    assert ds.data_order == {"shuffle_seed": 3, "batch_size": 4, "examples": 10}


# -- text: tiny_shakespeare, its vocabulary and its windows ------------------------------------
needs_shakespeare = pytest.mark.skipif(
    not os.path.isdir(os.path.join(_TFDS_DIR, "tiny_shakespeare")),
    reason="needs tiny_shakespeare prepared by tfds: set TFDS_DATA_DIR to a directory holding it",
)


def test_a_vocabulary_is_the_sorted_characters_and_round_trips():
    vocab = text_data.Vocabulary.of("to be, or not to be")
    assert vocab.characters == " ,benort" and len(vocab) == 8
    ids = vocab.encode("be not")
    assert ids.dtype == np.int32 and ids.tolist() == [2, 3, 0, 4, 5, 7]
    assert vocab.decode(ids) == "be not"
    assert text_data.Vocabulary(**dataclasses.asdict(vocab)) == vocab  # what a checkpoint saves is JSON


def test_a_character_outside_the_vocabulary_is_named_with_what_is_allowed():
    with pytest.raises(ValueError) as caught:
        text_data.Vocabulary("abc").encode("cab!")
    assert str(caught.value) == "the character '!' (at 3) is not in the vocabulary; allowed: 'abc'"


@pytest.mark.parametrize(("characters", "shown"), [("ba", "'ba'"), ("aab", "'aab'"), (["a"], "['a']")])
def test_a_vocabulary_of_unsorted_or_repeated_characters_is_refused(characters, shown):
    with pytest.raises(ValueError) as caught:
        text_data.Vocabulary(characters)
    assert str(caught.value) == (
        f"Vocabulary: characters must be a str of distinct characters in sorted order, got {shown}; "
        "build one with Vocabulary.of(text)"
    )


@pytest.mark.parametrize(
    ("ids", "what"), [([0, 3], "id 3 at 1"), ([-1], "id -1 at 0"), ([0.5], "shape (1,), dtype float64")]
)
def test_decode_refuses_an_id_outside_the_vocabulary(ids, what):
    with pytest.raises(ValueError) as caught:
        text_data.Vocabulary("abc").decode(ids)
    assert str(caught.value) == f"Vocabulary.decode: ids must be a list of ints from 0 to 2, got {what}"
    assert text_data.Vocabulary("abc").decode([]) == ""


def test_a_text_of_batch_size_0_is_refused_by_name():
    with pytest.raises(ValueError) as caught:
        text_data.TextDataset(np.arange(10, dtype=np.int32), context=3, batch_size=0)
    assert str(caught.value) == "TextDataset: batch_size must be a positive int, got 0"


def test_an_empty_vocabulary_is_refused_when_built_not_at_its_first_encode():
    with pytest.raises(ValueError) as caught:  # an IndexError of numpy's, at encode, before
        text_data.Vocabulary("")
    assert str(caught.value) == "Vocabulary: no characters; a model reads and writes at least one"
    assert text_data.Vocabulary("a").encode("a").tolist() == [0]


NOT_IDS = "the text must be a 1-d numpy array of integer ids, got shape"


@pytest.mark.parametrize(
    ("ids", "options", "message"),
    [
        (np.arange(10) + 0.5, {}, f"{NOT_IDS} (10,), dtype float64"),
        (list(range(10)), {}, f"{NOT_IDS} (10,), dtype list"),
        (np.zeros((2, 5), np.int32), {}, f"{NOT_IDS} (2, 5), dtype int32"),
        (np.arange(-1, 9), {}, "the text's ids run from -1 to 8; a character's id is 0 up"),
        (np.arange(10), {"vocabulary": text_data.Vocabulary("abc")}, "the text's ids run from 0 to 9; a "
         "character's id is 0 to 2 (its vocabulary)"),
    ],
)  # fmt: skip
def test_a_text_of_other_than_integer_ids_of_its_vocabulary_is_refused_by_name(ids, options, message):
    """Float ids were dealt out as float windows, to fail in the model's embedding."""
    with pytest.raises(ValueError) as caught:
        text_data.TextDataset(ids, context=3, batch_size=2, **options)
    assert str(caught.value) == "TextDataset: " + message
    vocabulary = text_data.Vocabulary("0123456789")
    assert (
        text_data.TextDataset(np.arange(10), 3, 2, vocabulary=vocabulary).batch(0)["inputs"].dtype.kind == "i"
    )


def numbered_text(n=100, context=4, batch_size=4, **options):
    """A text whose character ids are their positions, so a window shows where it was cut."""
    return text_data.TextDataset(np.arange(n, dtype=np.int32), context, batch_size, **options)


def test_training_windows_are_a_pure_function_of_seed_and_step():
    text = numbered_text()
    batch = text.batch(7)
    assert batch["inputs"].shape == batch["targets"].shape == (4, 4) and batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)  # the next character
    np.testing.assert_array_equal(np.diff(batch["inputs"], axis=1), 1)  # consecutive characters
    again = numbered_text()  # what a resumed process builds
    np.testing.assert_array_equal(again.batch(7)["inputs"], batch["inputs"])
    assert not np.array_equal(text.batch(8)["inputs"], batch["inputs"])
    assert not np.array_equal(numbered_text(seed=1).batch(7)["inputs"], batch["inputs"])
    starts = np.concatenate([text.batch(step)["inputs"][:, 0] for step in range(200)])
    assert starts.min() == 0 and starts.max() == 100 - 4 - 1  # every start with a full window can come


def test_a_text_is_what_fit_trains_on_and_evaluates_by_steps():
    text = numbered_text(n=23, context=4, batch_size=4)
    assert text.steps_per_epoch is None  # no epochs: fit trains it by steps
    assert text.data_order == {"seed": 0, "batch_size": 4, "context": 4}  # a checkpoint's, to resume by
    drawn = list(text.batches(5, 8))
    assert len(drawn) == 3 and all(
        np.array_equal(batch["inputs"], text.batch(step)["inputs"]) for batch, step in zip(drawn, range(5, 8))
    )
    for epoch in (0, 3):  # every evaluation reads the same windows
        evaluated = [batch["inputs"] for batch in text.epoch(epoch)]
        assert all(np.array_equal(a, b["inputs"]) for a, b in zip(evaluated, text.evaluation(), strict=True))
    assert len(list(text.epoch(0, start_batch=1))) == 1


def test_each_process_gets_its_rows_of_every_text_batch():
    whole = numbered_text(batch_size=8, process_index=0, process_count=1)
    parts = [numbered_text(batch_size=8, process_index=p, process_count=2) for p in (0, 1)]
    joined = np.concatenate([part.batch(3)["inputs"] for part in parts])
    np.testing.assert_array_equal(joined, whole.batch(3)["inputs"])
    evaluated = [np.concatenate([b["inputs"] for b in part.evaluation()]) for part in parts]
    assert sum(len(e) for e in evaluated) == len(list(whole.evaluation())) * 8


def test_evaluation_windows_are_fixed_and_make_every_character_a_target_once():
    text = numbered_text(n=23, context=4, batch_size=4)
    batches = list(text.evaluation())
    assert len(batches) == 2 and [b["mask"].tolist() for b in batches][-1] == [1.0, 0.0, 0.0, 0.0]
    targets = np.concatenate([b["targets"][b["mask"] == 1] for b in batches]).ravel()
    np.testing.assert_array_equal(targets, np.arange(1, 21))  # 5 windows of 4; the last 2 don't fit
    again = [b["inputs"] for b in text.evaluation(batch_size=8)]  # another batch size: the same windows
    first = np.concatenate([b["inputs"] for b in batches])[:5]
    np.testing.assert_array_equal(np.concatenate(again)[:5], first)


@pytest.mark.parametrize("context", [0, 100, 4.0])
def test_a_context_that_does_not_fit_the_split_is_one_line_naming_it(context):
    with pytest.raises(ValueError) as caught:
        numbered_text(n=100, context=context, name="tiny 'test' split")
    message = str(caught.value)
    assert message.startswith(f"context {context!r}: the tiny 'test' split has 100 characters")
    assert "from 1 to 99" in message and "\n" not in message


def test_unknown_text_datasets_and_splits_name_what_is_allowed():
    with pytest.raises(ValueError, match="unknown text dataset 'shakespeare'; choose from tiny_shakespeare"):
        text_data.text_dataset("shakespeare", "train", 64, 16)
    with pytest.raises(ValueError, match="unknown split 'valid'; choose from train, validation, test"):
        text_data.tiny_shakespeare("valid", 64, 16)


@needs_shakespeare
def test_tiny_shakespeare_splits_and_vocabulary_are_tfds_own(monkeypatch):
    splits = {
        split: text_data.tiny_shakespeare(split, 64, 16, download=False) for split in text_data.TEXT_SPLITS
    }
    sizes = {split: len(text.ids) for split, text in splits.items()}
    assert sizes == {"train": 1_003_854, "validation": 55_770, "test": 55_770}
    info = text_data.TEXT_DATASET_INFO["tiny_shakespeare"]
    vocab = splits["train"].vocabulary
    assert len(vocab) == info.vocabulary_size == 65 and sizes["train"] == info.train_characters
    assert sizes["validation"] == sizes["test"] == info.held_out_characters  # what --context must fit
    assert vocab.characters == "".join(sorted(vocab.characters)) and vocab.characters[:3] == "\n !"
    assert all(text.vocabulary == vocab for text in splits.values())  # the train split's, for every split
    # Oracle: the text read straight from TFDS.
    import tensorflow_datasets as tfds

    (example,) = tfds.as_numpy(tfds.load("tiny_shakespeare", split="validation", data_dir=_TFDS_DIR))
    assert vocab.decode(splits["validation"].ids) == example["text"].decode("utf-8")
    assert len(splits["validation"].windows) == (55_770 - 1) // 64 == 871
    # Read once per process: a second load never reaches TFDS.
    _, tfds_module = tfds_reading.tensorflow()
    monkeypatch.setattr(tfds_module, "load", lambda *args, **kwargs: pytest.fail("read twice"))
    assert len(text_data.tiny_shakespeare("test", 32, 8, download=False).ids) == 55_770


def test_missing_text_is_one_clear_error(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    with pytest.raises(tfds_reading.DataError) as caught:
        text_data.tiny_shakespeare("train", 64, 16, data_dir=str(tmp_path), download=False)
    message = str(caught.value)
    assert "'tiny_shakespeare' split 'train' is not prepared in" in message and str(tmp_path) in message
    assert "--data-dir" in message and list(tmp_path.iterdir()) == []
