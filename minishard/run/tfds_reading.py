"""Reading through TFDS: what the image and the text data sets share (``data``, ``text_data``).

TensorFlow and TFDS are imported on first use (``tensorflow``), so ``import
minishard`` stays fast without them; ``load`` is ``tfds.load`` with its failure
said in two lines, ``pull`` turns a ``tf.data`` pipeline into numpy and names a
damaged record file with how to re-prepare it, and ``data_directory`` is TFDS's own
rule for where prepared data sets live, resolved here so an error can say where
it looked. Each kind of data set (images, text) says what to read; this module
says how, and what went wrong.

>>> data_directory("prepared")
'prepared'
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
from typing import Any

__all__ = ["DataError", "data_directory", "load", "pull", "tensorflow"]


class DataError(RuntimeError):
    """The data is not where we looked, could not be downloaded, or is damaged; the message says which."""


@functools.cache
def tensorflow() -> tuple[Any, Any]:
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


def load(name: str, split: str, data_dir: str | None, download: bool, **options: Any) -> tuple[Any, str]:
    """``tfds.load``, its failure said in two lines; and the directory it looked in."""
    _, tfds = tensorflow()
    data_dir = data_directory(data_dir)
    try:
        return tfds.load(name, split=split, data_dir=data_dir, download=download, **options), data_dir
    except Exception as err:  # TF's own error is a page of traceback: say it in two lines
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        how = "and downloading it failed" if download else "and download=False"
        raise DataError(
            f"{name!r} split {split!r} is not prepared in {data_dir} {how}: {reason}\n"
            "Point at a prepared directory with --data-dir DIR or TFDS_DATA_DIR=DIR."
        ) from None


def data_directory(data_dir: str | None) -> str:
    """TFDS's own rule, resolved here so an error can say where it looked."""
    if data_dir is None:
        return os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))
    return data_dir


def pull(ds: Any, name: str, split: str, data_dir: str) -> list[Any]:
    """Every element of ``ds`` as numpy; a damaged record file named, with how to re-prepare it."""
    tf, tfds = tensorflow()
    try:
        return list(tfds.as_numpy(ds))
    except tf.errors.OpError as err:  # a truncated or damaged record file
        message = re.sub(r"\{\{.*?\}\}|\[Op:.*", "", err.message).strip(" '\n")  # drop TF's op names
        reason = f"{type(err).__name__}: {message}"
    # Raised outside the except clause, so the DataError does not hold TF's error (as __context__),
    # whose traceback holds the failed tf.data pipeline: it is freed here. Held, it was freed by some
    # later garbage collection, which then took 40-46 s in the middle of another test (measured).
    files = sorted(glob.glob(os.path.join(data_dir, name, "*", f"{name}-{split.split('[')[0]}.*")))
    raise DataError(
        f"{name!r} split {split!r} in {data_dir} cannot be read ({reason}) "
        f"from {', '.join(files) or 'its record files'}\n"
        f"Re-prepare it: delete {os.path.join(data_dir, name)} and run again with downloads allowed "
        "(or copy a good prepared directory there)."
    )
