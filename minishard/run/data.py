"""The input pipeline: TFDS reads the data once, numpy deals it out in batches.

Training must be able to stop and resume *exactly*, so the position in the
data is three numbers: ``(shuffle_seed, epoch, batch index)``. Everything here
follows from that:

* each split is read once through ``tfds.load`` into in-memory numpy arrays
  (MNIST's 60,000 images are 47 MB as uint8);
* an epoch's order is a pure function of ``(shuffle_seed, epoch)``, a numpy
  permutation, so resuming at batch ``b`` of epoch ``e`` is just slicing;
* every batch has the same shape, because jit compiles once per shape and the
  batch axis is split evenly over the mesh's ``"data"`` axis. Training drops
  the last partial batch; evaluation pads it and a ``mask`` marks real rows.

A batch is a dict of numpy arrays, ``image`` float32 [B, features] (or
[B, H, W, C] with ``flatten=False``), ``label`` int32 [B], ``mask`` float32 [B]
(1.0 real, 0.0 padding). ``to_global`` turns it into sharded ``jax.Array`` s.

>>> ds = Dataset(np.zeros((10, 2, 2, 1), np.uint8), np.arange(10), batch_size=4, shuffle=False)
>>> [batch["mask"].tolist() for batch in ds.epoch(0)]
[[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
"""

from __future__ import annotations

import contextlib
import functools
import glob
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

Batch = dict[str, np.ndarray]
"""``{"image": float32 [B, ...], "label": int32 [B], "mask": float32 [B]}``."""


class DataError(RuntimeError):
    """The data is not where we looked, could not be downloaded, or is damaged; the message says which."""


class Dataset:
    """One split in memory, dealt out as fixed-size batches, epoch by epoch.

    ``images`` stay uint8 (4x smaller than float32); each batch is cast to
    float32 and divided by 255 when it is gathered. ``batch_size`` is the
    *global* batch: with several processes, each one yields its own contiguous
    ``batch_size // process_count`` rows of every global batch, the rows that
    ``jax.make_array_from_process_local_data`` expects from it.

    >>> ds = Dataset(np.zeros((10, 28, 28, 1), np.uint8), np.arange(10), batch_size=4)
    >>> ds.steps_per_epoch, next(ds.epoch(0))["image"].shape   # shuffled: drops 2
    (2, (4, 784))
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_remainder: bool | None = None,
        shuffle_seed: int = 0,
        flatten: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> None:
        if len(images) != len(labels):
            raise ValueError(f"Dataset: {len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels.astype(np.int32)
        self.batch_size, self.shuffle, self.shuffle_seed = batch_size, shuffle, shuffle_seed
        self.flatten = flatten
        self.drop_remainder = shuffle if drop_remainder is None else drop_remainder
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if batch_size < 1 or batch_size % self.process_count:
            raise ValueError(f"batch_size {batch_size} must be a multiple of {self.process_count} processes")
        rounding = math.floor if self.drop_remainder else math.ceil
        self.steps_per_epoch = rounding(self.num_examples / batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(f"batch_size {batch_size} is larger than the {self.num_examples} examples")

    @property
    def num_examples(self) -> int:
        """Examples in the split (padding not counted)."""
        return len(self.labels)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        """The example indices of ``epoch`` in the order they are served."""
        if not self.shuffle:
            return np.arange(self.num_examples)
        # Seeding with the pair makes the permutation a pure function of it:
        # no hidden RNG state to checkpoint, any epoch can be replayed alone.
        return np.random.default_rng([self.shuffle_seed, epoch]).permutation(self.num_examples)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        """Yield the batches of ``epoch`` from batch ``start_batch`` on (resume)."""
        if not 0 <= start_batch <= self.steps_per_epoch:
            raise ValueError(f"start_batch {start_batch} is outside 0..{self.steps_per_epoch}")
        # A [steps, batch_size] table of example indices; -1 marks padding.
        flat = np.full(self.steps_per_epoch * self.batch_size, -1)
        order = self.order(epoch)[: flat.size]
        flat[: len(order)] = order
        table = flat.reshape(self.steps_per_epoch, self.batch_size)
        local = self.batch_size // self.process_count
        columns = slice(self.process_index * local, (self.process_index + 1) * local)
        return (self._gather(rows) for rows in table[start_batch:, columns])

    def _gather(self, rows: np.ndarray) -> Batch:
        mask = rows >= 0
        rows = np.where(mask, rows, 0)  # padding repeats example 0, masked out
        image = self.images[rows].astype(np.float32) / np.float32(255)
        if self.flatten:
            image = image.reshape(len(rows), -1)
        return {"image": image, "label": self.labels[rows], "mask": mask.astype(np.float32)}


def to_global(
    batch: Batch, sharding: jax.sharding.Sharding, fields: Sequence[str] | None = None
) -> dict[str, jax.Array]:
    """Assemble each process's rows into one global ``jax.Array`` per field (``fields``: only those).

    With one process this is ``jax.device_put`` along the batch axis; with
    several, every process passes its local rows and JAX stitches them into a
    single logical array, e.g. ``NamedSharding(mesh, P("data"))``.
    """
    chosen = batch if fields is None else {key: batch[key] for key in fields}
    if jax.process_count() == 1:  # the same arrays, without the multi-process bookkeeping
        return jax.device_put(chosen, sharding)  # one call places every field
    return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in chosen.items()}


# -- reading through TFDS ------------------------------------------------------
@functools.cache
def _tensorflow() -> tuple[Any, Any]:
    """Import TF and TFDS on first use: ``import minishard`` stays fast without them."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # C++ log noise; read at import
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # its banner ignores the line above
    try:
        import tensorflow as tf
        import tensorflow_datasets as tfds
        from absl import logging as absl_logging
    except ImportError as err:
        raise ImportError(f"{err.name} is missing: pip install 'minishard[data]'") from None
    # TF only reads files: accelerators stay JAX's. (If the caller already
    # started TF, this raises RuntimeError and the caller's choice stands.)
    with contextlib.suppress(RuntimeError):
        tf.config.set_visible_devices([], "GPU")
    absl_logging.set_verbosity(absl_logging.ERROR)
    tf.get_logger().setLevel("ERROR")
    tfds.disable_progress_bar()
    return tf, tfds


def _read(
    name: str, split: str, prepare: Callable[[Any], Any], data_dir: str | None, download: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``tfds.load`` one split and pull it into numpy: (uint8 images, labels)."""
    tf, tfds = _tensorflow()
    # TFDS's own rule, resolved here so an error can say where it looked.
    if data_dir is None:
        data_dir = os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))
    try:
        ds = tfds.load(name, split=split, as_supervised=True, data_dir=data_dir, download=download)
    except Exception as err:  # TF's own error is a page of traceback: say it in two lines
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        how = "and downloading it failed" if download else "and download=False"
        raise DataError(
            f"{name!r} split {split!r} is not prepared in {data_dir} {how}: {reason}\n"
            "Point at a prepared directory with --data-dir DIR or TFDS_DATA_DIR=DIR."
        ) from None
    ds = ds.map(lambda image, label: (prepare(image), label), num_parallel_calls=tf.data.AUTOTUNE)
    try:
        chunks = list(tfds.as_numpy(ds.batch(8192).prefetch(tf.data.AUTOTUNE)))
    except tf.errors.OpError as err:  # a truncated or damaged record file
        reason = re.sub(r"\{\{.*?\}\}|\[Op:.*", "", err.message).strip(" '\n")  # drop TF's op names
        files = sorted(glob.glob(os.path.join(data_dir, name, "*", f"{name}-{split.split('[')[0]}.*")))
        raise DataError(
            f"{name!r} split {split!r} in {data_dir} cannot be read ({type(err).__name__}: {reason}) "
            f"from {', '.join(files) or 'its record files'}\n"
            f"Re-prepare it: delete {os.path.join(data_dir, name)} and run again with downloads allowed "
            "(or copy a good prepared directory there)."
        ) from None
    return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])


def _is_train(split: str) -> bool:
    """Splits of "train" (``"train"``, ``"train[:10%]"``) shuffle and drop by default."""
    return split.split("[")[0] == "train"


def _dataset(
    name: str,
    split: str,
    tfds_split: str,
    prepare: Callable[[Any], Any],
    batch_size: int,
    *,
    data_dir: str | None = None,
    download: bool = True,
    shuffle: bool | None = None,
    **options: Any,
) -> Dataset:
    """Read ``tfds_split`` of dataset ``name``; train splits shuffle unless told otherwise."""
    images, labels = _read(name, tfds_split, prepare, data_dir, download)
    classes = DATASET_INFO[name].num_classes
    if len(labels) and (labels.min() < 0 or labels.max() >= classes):  # checked once here, never per step
        raise DataError(
            f"{name!r} split {split!r} has labels from {labels.min()} to {labels.max()}, "
            f"outside [0, {classes})"
        )
    shuffle = _is_train(split) if shuffle is None else shuffle
    return Dataset(images, labels, batch_size, shuffle=shuffle, **options)


def mnist(
    split: str,
    batch_size: int,
    *,
    data_dir: str | None = None,
    download: bool = True,
    shuffle_seed: int = 0,
    flatten: bool = True,
    **options: Any,
) -> Dataset:
    """MNIST ``"train"`` (shuffled, drops the partial batch) or ``"test"`` (in order, padded).

    ``data_dir`` defaults to TFDS's own rules (``$TFDS_DATA_DIR``, then
    ``~/tensorflow_datasets``); ``download=False`` never touches the network.
    ``options`` go to ``Dataset``: ``shuffle``, ``drop_remainder``,
    ``process_index``, ``process_count``.
    """
    return _dataset(
        "mnist", split, split, lambda image: image, batch_size,
        data_dir=data_dir, download=download, shuffle_seed=shuffle_seed, flatten=flatten, **options,
    )  # fmt: skip


CATS_VS_DOGS_SPLITS = {"train": "train[:80%]", "test": "train[80%:]"}
"""TFDS has only a ``train`` split of cats_vs_dogs; we hold out its last 20%."""


def cats_vs_dogs(split: str, batch_size: int, **options: Any) -> Dataset:
    """Cats (0) vs dogs (1), photos of any size resized to 200x200x3 for the MLP; options as for ``mnist``.

    Resizing gives float pixels; they are rounded back to uint8 so 23,262
    images take 2.8 GB in memory instead of 11 GB (an error under 0.002).
    """
    tf, _ = _tensorflow()

    def resize(image: Any) -> Any:
        return tf.saturate_cast(tf.round(tf.image.resize(image, (200, 200))), tf.uint8)

    tfds_split = CATS_VS_DOGS_SPLITS.get(split, split)
    return _dataset("cats_vs_dogs", split, tfds_split, resize, batch_size, **options)


@dataclass(frozen=True)
class DatasetInfo:
    """What a model (and the CLI's checks) need to know before any data is read."""

    input_shape: tuple[int, ...]
    num_classes: int
    train_examples: int  # in minishard's "train" split

    @property
    def num_features(self) -> int:
        """Length of a flattened image: the MLP's input size."""
        return math.prod(self.input_shape)


DATASETS: dict[str, Callable[..., Dataset]] = {"mnist": mnist, "cats_vs_dogs": cats_vs_dogs}
DATASET_INFO = {
    "mnist": DatasetInfo((28, 28, 1), 10, 60_000),
    "cats_vs_dogs": DatasetInfo((200, 200, 3), 2, 18_610),  # 80% of TFDS's 23,262 images
}

__all__ = [
    "CATS_VS_DOGS_SPLITS",
    "DATASETS",
    "DATASET_INFO",
    "Batch",
    "DataError",
    "Dataset",
    "DatasetInfo",
    "cats_vs_dogs",
    "mnist",
    "to_global",
]
