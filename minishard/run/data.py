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

Text (``tiny_shakespeare``) is dealt out as windows of characters by a module
of its own, ``text_data``; both read through ``tfds_reading``.

>>> ds = Dataset(np.zeros((10, 2, 2, 1), np.uint8), np.arange(10), batch_size=4, shuffle=False)
>>> [batch["mask"].tolist() for batch in ds.epoch(0)]
[[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from minishard.losses import (
    Batch,  # here: {"image": float32 [B, ...], "label": int32 [B], "mask": float32 [B]}
)
from minishard.run import distributed, tfds_reading
from minishard.run.tfds_reading import DataError


class TrainingData(Protocol):
    """What ``fit`` trains on: the batch of every step a pure function of the data's settings and the step.

    So a run resumed at step ``s`` sees exactly the batches a straight run would.
    ``Dataset`` deals a split out epoch by epoch (``steps_per_epoch``); a source
    that draws each step's batch from ``(seed, step)`` has no epochs (None).
    """

    @property
    def batch_size(self) -> int: ...  # the global batch

    @property
    def steps_per_epoch(self) -> int | None: ...  # None: no epochs

    def batches(self, start: int, stop: int) -> Iterator[Batch]: ...  # the batches of steps start .. stop - 1

    @property
    def data_order(self) -> dict[str, Any]: ...  # what fixes the batches (seed, batch size, ...)


class EvalData(Protocol):
    """What an evaluation reads: epoch 0, every example once, in fixed-shape batches (padding masked)."""

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]: ...


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
        self.rows = process_rows(batch_size, self.process_index, self.process_count)
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
        return (self._gather(rows) for rows in table[start_batch:, self.rows])

    def batches(self, start: int, stop: int) -> Iterator[Batch]:
        """The training batches of steps ``start .. stop - 1``, across epochs: ``TrainingData``.

        Step ``s`` is batch ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``;
        a training batch holds ``image`` and ``label`` (training never pads: no mask).
        """
        while start < stop:
            epoch, first = divmod(start, self.steps_per_epoch)
            count = min(stop - start, self.steps_per_epoch - first)
            for batch in itertools.islice(self.epoch(epoch, first), count):
                yield {"image": batch["image"], "label": batch["label"]}
            start += count

    @property
    def data_order(self) -> dict[str, int]:
        """What fixes the examples of batch ``b`` of epoch ``e``: a checkpoint resumes only with the same."""
        order = {"shuffle_seed": self.shuffle_seed, "batch_size": self.batch_size}
        return {**order, "examples": self.num_examples}

    def _gather(self, rows: np.ndarray) -> Batch:
        mask = rows >= 0
        rows = np.where(mask, rows, 0)  # padding repeats example 0, masked out
        image = self.images[rows].astype(np.float32) / np.float32(255)
        if self.flatten:
            image = image.reshape(len(rows), -1)
        return {"image": image, "label": self.labels[rows], "mask": mask.astype(np.float32)}


def process_rows(batch_size: int, process_index: int, process_count: int) -> slice:
    """This process's rows of every global batch: its contiguous ``batch_size // process_count``.

    >>> process_rows(8, process_index=1, process_count=2)
    slice(4, 8, None)
    """
    if batch_size < 1 or batch_size % process_count:
        raise ValueError(f"batch_size {batch_size} must be a multiple of {process_count} processes")
    local = batch_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


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


def check_batch_split(sharding: jax.sharding.Sharding, batch_size: int) -> None:
    """Fail unless process ``p`` holds rows ``[p * B/N, (p+1) * B/N)`` of a global batch.

    That is what ``Dataset`` gives each process, and what ``to_global``
    (``jax.make_array_from_process_local_data``) assumes. It holds when the
    mesh's batch axis comes first and is a multiple of the process count,
    e.g. ``data=2,model=4`` on 2 processes of 4 devices; ``model=4,data=2`` or
    ``data=1,model=8`` would give each process the *whole* batch to supply.

    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices())
    >>> check_batch_split(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")), 64)
    """
    count = jax.process_count()
    if count == 1:
        return
    local = batch_size // count
    rows: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map((batch_size,)).items():
        process = device.process_index  # type: ignore[attr-defined]  # jaxlib's Device has it, its stub not
        rows.setdefault(process, set()).update(range(batch_size)[index[0]])
    for process, held in sorted(rows.items()):
        if held != set(range(process * local, (process + 1) * local)):
            first, last = min(held), max(held)
            raise distributed.DistributedError(
                f"process {process}'s devices hold rows {first}..{last} ({len(held)} rows) of each "
                f"batch of {batch_size}, but each of the {count} processes reads its own {local} rows: "
                "put the batch (data) axis first in --mesh and make it a multiple of the process count"
            )


# -- images through TFDS (``tfds_reading``) -------------------------------------
def _read(
    name: str, split: str, prepare: Callable[[Any], Any], data_dir: str | None, download: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``tfds.load`` one split and pull it into numpy: (uint8 images, labels)."""
    tf, _ = tfds_reading.tensorflow()
    ds, data_dir = tfds_reading.load(name, split, data_dir, download, as_supervised=True)
    ds = ds.map(lambda image, label: (prepare(image), label), num_parallel_calls=tf.data.AUTOTUNE)
    chunks = tfds_reading.pull(ds.batch(8192).prefetch(tf.data.AUTOTUNE), name, split, data_dir)
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
        "mnist",
        split,
        split,
        lambda image: image,
        batch_size,
        data_dir=data_dir,
        download=download,
        shuffle_seed=shuffle_seed,
        flatten=flatten,
        **options,
    )


CATS_VS_DOGS_SPLITS = {"train": "train[:80%]", "test": "train[80%:]"}
"""TFDS has only a ``train`` split of cats_vs_dogs; we hold out its last 20%."""


def cats_vs_dogs(split: str, batch_size: int, **options: Any) -> Dataset:
    """Cats (0) vs dogs (1), photos of any size resized to 200x200x3 for the MLP; options as for ``mnist``.

    Resizing gives float pixels; they are rounded back to uint8 so 23,262
    images take 2.8 GB in memory instead of 11 GB (an error under 0.002).
    """
    tf, _ = tfds_reading.tensorflow()

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
    "Dataset",
    "DatasetInfo",
    "EvalData",
    "TrainingData",
    "cats_vs_dogs",
    "check_batch_split",
    "mnist",
    "process_rows",
    "to_global",
]
