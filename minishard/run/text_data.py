"""Text data: one string per split, dealt out as windows of characters (tiny_shakespeare, the GPT's).

It comes the way the images do (``data``): each split is read once through TFDS
(``tfds_reading``) into memory, and the position in the data is what a
checkpoint saves. Training has no epochs here: a step's windows are a pure
function of ``(seed, step)``, so the position in the data is the step alone.
Characters become ids by the sorted characters of the train split
(``Vocabulary``), saved with a checkpoint, so sampling needs no data. Its own
module, beside the images', because a language model reads nothing else of them.

>>> text = TextDataset(np.arange(10, dtype=np.int32), context=3, batch_size=2)
>>> text.batch(0)["inputs"].shape, text.steps_per_epoch
((2, 3), None)
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from minishard.losses import Batch
from minishard.run import tfds_reading
from minishard.run.data import process_rows

__all__ = [
    "TEXT_DATASET_INFO",
    "TEXT_SPLITS",
    "TextDataset",
    "TextInfo",
    "Vocabulary",
    "text_dataset",
    "tiny_shakespeare",
]


@dataclass(frozen=True)
class Vocabulary:
    """The characters a model reads and writes, sorted: id ``i`` is ``characters[i]``.

    Built from the train split (``of``), so it is the same in every run; it is
    one string, so a checkpoint saves it (``dataclasses.asdict`` is JSON) and
    sampling needs no data.

    >>> vocab = Vocabulary.of("hello")
    >>> vocab.characters, vocab.encode("hole").tolist(), vocab.decode([3, 1])
    ('ehlo', [1, 3, 2, 0], 'oh')
    """

    characters: str

    def __post_init__(self) -> None:
        """``searchsorted`` finds a character only in sorted, distinct ones: refuse others, by name."""
        chars = self.characters
        if not isinstance(chars, str) or list(chars) != sorted(set(chars)):
            raise ValueError(
                "Vocabulary: characters must be a str of distinct characters in sorted order, got "
                f"{chars!r:.80}; build one with Vocabulary.of(text)"
            )
        if not chars:  # encode would index an empty table
            raise ValueError("Vocabulary: no characters; a model reads and writes at least one")

    @classmethod
    def of(cls, text: str) -> Vocabulary:
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.characters)

    def encode(self, text: str) -> np.ndarray:
        """``text`` as int32 ids; a character outside the vocabulary is refused, by name."""
        table, codes = _code_points(self.characters), _code_points(text)
        ids = np.searchsorted(table, codes)  # sorted characters: a binary search per character
        unknown = table[np.minimum(ids, len(table) - 1)] != codes
        if unknown.any():
            at = int(np.argmax(unknown))
            raise ValueError(
                f"the character {text[at]!r} (at {at}) is not in the vocabulary; allowed: {self.characters!r}"
            )
        return ids.astype(np.int32)

    def decode(self, ids: Any) -> str:
        """The text of ``ids``, a list of ids from 0 to ``len(self) - 1``; any other is refused, by place."""
        ids = np.asarray(ids)
        bad = ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer))
        if bad or (wrong := np.flatnonzero((ids < 0) | (ids >= len(self)))).size:
            at = f"shape {ids.shape}, dtype {ids.dtype}" if bad else f"id {ids[wrong[0]]} at {wrong[0]}"
            last = len(self) - 1
            raise ValueError(f"Vocabulary.decode: ids must be a list of ints from 0 to {last}, got {at}")
        return "".join(self.characters[i] for i in ids.tolist())


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), np.uint32)


def _check_ids(ids: np.ndarray, vocabulary: Vocabulary | None, name: str) -> None:
    """A text is a 1-d array of integer ids, each a character of its vocabulary (from 0): float ids
    would be dealt out as windows and fail in the model's embedding, far from here."""
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        got = f"shape {np.shape(ids)}, dtype {getattr(ids, 'dtype', type(ids).__name__)}"
        wanted = "a 1-d numpy array of integer ids"
        raise ValueError(f"TextDataset: the {name} must be {wanted}, got {got}")
    most = len(vocabulary) - 1 if vocabulary is not None else None
    if ids.size and (ids.min() < 0 or (most is not None and ids.max() > most)):
        allowed = f"0 to {most} (its vocabulary)" if most is not None else "0 up"
        raise ValueError(
            f"TextDataset: the {name}'s ids run from {ids.min()} to {ids.max()}; a character's id "
            "is "
            f"{allowed}"
        )


class TextDataset:
    """One split of a text as character ids, dealt out in windows of ``context + 1`` characters.

    A window's first ``context`` characters are the ``inputs``, its last
    ``context`` the ``targets`` (each input's next character): ``{"inputs":
    int32 [B, context], "targets": int32 [B, context]}``.

    * ``batch(step)``: training. ``batch_size`` windows at random starts drawn
      from ``np.random.default_rng([seed, step])``: a pure function of the step,
      so a resumed run sees exactly the batches a straight run would.
    * ``evaluation()``: the split tiled by consecutive windows, so every
      character but the first is a target once. The same windows every time;
      the last batch is padded and a ``mask`` marks real windows, as ``Dataset``'s.

    So it is what ``fit`` trains on by steps (``batches``, ``data_order``, no
    epochs) and what it evaluates (``epoch``: ``evaluation()`` whatever the epoch).

    >>> text = TextDataset(np.arange(10, dtype=np.int32), context=3, batch_size=2)
    >>> text.batch(5)["inputs"].shape, len(text.windows)
    ((2, 3), 3)
    >>> [batch["targets"][0].tolist() for batch in text.evaluation()]
    [[1, 2, 3], [7, 8, 9]]
    """

    def __init__(
        self,
        ids: np.ndarray,
        context: int,
        batch_size: int,
        *,
        seed: int = 0,
        vocabulary: Vocabulary | None = None,
        name: str = "text",
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> None:
        _check_ids(ids, vocabulary, name)
        if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context < len(ids):
            raise ValueError(
                f"context {context!r}: the {name} has {len(ids):,} characters, so a window of context + 1 "
                f"fits for a context from 1 to {len(ids) - 1:,}"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise ValueError(f"TextDataset: batch_size must be a positive int, got {batch_size!r}")
        self.ids, self.context, self.batch_size, self.seed = ids, context, batch_size, seed
        self.vocabulary, self.name = vocabulary, name
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        self.rows = process_rows(batch_size, self.process_index, self.process_count)
        self.windows = np.arange(0, len(ids) - context, context)  # evaluation's starts, fixed

    steps_per_epoch = None  # ``fit``'s ``TrainingData``: no epochs, each step draws its own windows

    @property
    def data_order(self) -> dict[str, int]:
        """What fixes every step's windows: a checkpoint keeps it, and a resumed run must match it."""
        return {"seed": self.seed, "batch_size": self.batch_size, "context": self.context}

    def batches(self, start: int, stop: int) -> Iterator[Batch]:
        """The training batches of steps ``start .. stop - 1``: ``batch`` of each."""
        return (self.batch(step) for step in range(start, stop))

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        """``fit``'s ``EvalData``: ``evaluation()``, the same windows whatever the epoch."""
        return itertools.islice(self.evaluation(), start_batch, None)

    def batch(self, step: int) -> Batch:
        """The training batch of ``step``: this process's rows of ``batch_size`` random windows."""
        rng = np.random.default_rng([self.seed, step])  # seeded by the pair: no hidden state to save
        starts = rng.integers(0, len(self.ids) - self.context, self.batch_size)
        return self._cut(starts[self.rows])

    def evaluation(self, batch_size: int | None = None) -> Iterator[Batch]:
        """Every window of ``windows`` once, in order, ``batch_size`` (default: training's) at a time."""
        batch_size = batch_size or self.batch_size
        rows = process_rows(batch_size, self.process_index, self.process_count)
        table = np.full(math.ceil(len(self.windows) / batch_size) * batch_size, -1)
        table[: len(self.windows)] = self.windows  # -1: padding
        for starts in table.reshape(-1, batch_size)[:, rows]:
            mask = starts >= 0
            yield {**self._cut(np.where(mask, starts, 0)), "mask": mask.astype(np.float32)}

    def _cut(self, starts: np.ndarray) -> Batch:
        windows = self.ids[starts[:, None] + np.arange(self.context + 1)]
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


TEXT_SPLITS = ("train", "validation", "test")


def text_dataset(
    name: str,
    split: str,
    context: int,
    batch_size: int,
    *,
    data_dir: str | None = None,
    download: bool = True,
    seed: int = 0,
    **options: Any,
) -> TextDataset:
    """Split ``split`` of the TFDS text dataset ``name``, ids by the vocabulary of its train split.

    ``data_dir`` and ``download`` as for ``mnist``; ``options`` go to ``TextDataset``.
    """
    if name not in TEXT_DATASET_INFO:
        raise ValueError(f"unknown text dataset {name!r}; choose from {', '.join(TEXT_DATASET_INFO)}")
    if split not in TEXT_SPLITS:
        raise ValueError(f"{name}: unknown split {split!r}; choose from {', '.join(TEXT_SPLITS)}")
    data_dir = tfds_reading.data_directory(data_dir)
    vocabulary = Vocabulary.of(_read_text(name, "train", data_dir, download))
    ids = vocabulary.encode(_read_text(name, split, data_dir, download))
    where = f"{name} {split!r} split"
    return TextDataset(ids, context, batch_size, seed=seed, vocabulary=vocabulary, name=where, **options)


def tiny_shakespeare(split: str, context: int, batch_size: int, **options: Any) -> TextDataset:
    """Karpathy's tiny_shakespeare (TFDS): 1,003,854 characters to train on, 55,770 each to validate, test."""
    return text_dataset("tiny_shakespeare", split, context, batch_size, **options)


@functools.cache
def _read_text(name: str, split: str, data_dir: str, download: bool) -> str:
    """The one example of a text split, read once per process (importing TF takes seconds)."""
    ds, data_dir = tfds_reading.load(name, split, data_dir, download)
    (example,) = tfds_reading.pull(ds, name, split, data_dir)
    return example["text"].decode("utf-8")


@dataclass(frozen=True)
class TextInfo:
    """What a language model needs before any text is read: its vocabulary's size."""

    vocabulary_size: int
    train_characters: int
    held_out_characters: int  # in each of the validation and test splits: a window must fit there too


TEXT_DATASET_INFO = {"tiny_shakespeare": TextInfo(65, 1_003_854, 55_770)}
