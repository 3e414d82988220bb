"""The guards of mixed precision (precision.py).

What each checks, and the words it says. A reader may skip this file, as ``minishard._checks``,
whose shared checks it uses; it imports nothing else of minishard.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from minishard._checks import count, is_finite


def copies_as_wide(precision: Mapping[str, Any]) -> None:
    """``Precision``'s copies hold more than what they copy: the master's numbers at least as wide as
    the weights', the accumulated gradients' as the gradients' (a narrower copy loses what it keeps)."""
    for copy, of in (("master", "params"), ("accumulated", "grads")):
        if precision[copy] is not None and _bytes(precision[copy]) < _bytes(precision[of]):
            raise ValueError(
                f"Precision: {copy}={precision[copy]!r} is narrower than {of}={precision[of]!r}: a copy "
                f"kept to hold what {of} lose must be at least as wide; give {copy}='float32', or None "
                "for no copy"
            )


def _bytes(dtype: str) -> int:
    return int(np.dtype(jnp.dtype(dtype)).itemsize)


def loss_scale(where: str, period: Any, factor: Any, floor: Any) -> None:
    """A dynamic loss scale's knobs: it grows by ``factor`` after ``period`` finite steps, shrinks by it
    on an overflow, never below ``floor``; a factor <= 1 would invert or freeze it."""
    count(f"{where}: period", period)
    if not is_finite(factor) or factor <= 1:
        raise ValueError(
            f"{where}: factor must be a finite number > 1 (the scale is multiplied by it after period "
            f"finite steps, divided by it on an overflow), got {factor!r}; jmp's default is 2"
        )
    if not is_finite(floor) or floor <= 0:
        raise ValueError(f"{where}: floor must be a finite number > 0 (the smallest scale), got {floor!r}")


def loss_scale_start(scale: Any) -> None:
    """A loss scale's first value: a finite number > 0 (NaN or inf would skip every step for ever)."""
    if not is_finite(scale) or scale <= 0:
        raise ValueError(
            f"LossScale.start: scale must be a finite number > 0 (the loss is multiplied by it), got "
            f"{scale!r}; jmp starts at 2**15"
        )


def scalar_bool(where: str, value: Any) -> None:
    """One boolean (a Python bool, or an array of shape () and dtype bool): a single yes or no."""
    if np.shape(value) != () or jnp.result_type(value) != jnp.bool_:
        raise ValueError(
            f"{where} must be one boolean (shape (), dtype bool), got dtype {jnp.result_type(value)} "
            f"shape {np.shape(value)}; all_finite(grads) gives it"
        )


def optimizer(where: str, value: Any) -> None:
    """An optimizer: an object with ``init``, ``update`` and ``learning_rate`` (``SGD``, ``AdamW``)."""
    if not all(hasattr(value, name) for name in ("init", "update", "learning_rate")):
        shown = f" {value!r}" if isinstance(value, str | numbers.Number) else ""
        raise TypeError(
            f"{where} must be an Optimizer (init, update, learning_rate), got a {type(value).__name__}"
            f"{shown}; e.g. LossScaled(AdamW(1e-3))"
        )


def loss_scaled_state(where: str, state: Any, cls: type) -> None:
    """The state ``LossScaled.init`` made (the inner optimizer's, beside the scale), not the inner one's."""
    if not isinstance(state, cls):
        raise TypeError(
            f"{where}: state must be a {cls.__name__} (the optimizer's state and the loss scale), got a "
            f"{type(state).__name__}; init it with the LossScaled optimizer, not the one inside it"
        )
