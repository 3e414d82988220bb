"""Recomputation: keep less for the backward pass, compute part of the forward pass twice.

The backward pass of a block needs what its forward pass computed: the inputs
of each matmul (for the weights' gradients), the softmax's output, the Swish's
input. Kept, they are most of a transformer step's memory (``minishard.memory``,
section 3); dropped, the backward pass recomputes them from what was kept.
``jax.checkpoint`` (alias ``jax.remat``) draws that line: wrapped around a block,
its *policy* says which of the block's intermediates may be saved, and the rest
are recomputed from the block's input (``checkpointed``; ``after_the_gradient`` makes
the recomputation wait for the gradient it serves). ``POLICIES`` is MaxText's
``remat_policy`` menu in small:

* ``none``: no ``jax.checkpoint``; autodiff keeps every residual it needs.
* ``full`` (``nothing_saveable``): only each block's input; the backward pass runs
  the whole block forward again: 4 forward passes' matmuls a step instead of 3.
* ``dots`` (``dots_saveable``): every matmul's output, the attention's scores
  ``q·k`` included; only elementwise work (norms, softmax, Swish) is recomputed.
* ``names`` (``save_only_these_names``): the intermediates named with
  ``checkpoint_name``, ``SAVED``: the projections' q, k, v (``QKV``) and the attention's
  output (``ATTENTION``). The attention core (scores, softmax, the sum over values) and the MLP
  are recomputed: Korthikanti et al.'s *selective* recomputation, which drops the
  ``as/h`` term (the softmax's ``b·heads·s²`` numbers), with the MLP's hidden
  units recomputed too.

What recomputation costs is FLOPs. A step's *model* FLOPs (``costs.model_flops``,
3 x the forward matmuls) are what the model needs, and MFU's numerator; its
*hardware* FLOPs (``step_flops``, a ``StepFlops``) are the matmuls the step runs,
recomputation included, and HFU's. Under ``full`` a block's forward matmuls run again, all but
the last: its output only feeds the residual sum, whose gradient needs none of it.
So a GPT step under ``full`` costs a little under 8N per token instead of 6N (the
MLP's second matmul is a sixth of a block's), HFU / MFU a little under 4/3.

>>> import jax.numpy as jnp
>>> w = jnp.ones((4, 4))
>>> def loss(w, x):
...     block = lambda w, x: jnp.tanh(x @ w) @ w   # two matmuls
...     return checkpointed(block, "full")(w, x).sum(), ()   # (value, metrics): a Loss
>>> flops = step_flops(loss, w, jnp.ones((2, 4)))
>>> flops.hardware / flops.model   # 3 + 1 of the 2 forward matmuls, over 3 x 2 of them
1.1666666666666667
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from minishard import _checks
from minishard.costs import matmul_flops, model_flops

QKV = "qkv"
"""The name ``Attention`` gives its projections' q, k, v (``jax.ad_checkpoint.checkpoint_name``:
outside ``jax.checkpoint`` it returns its argument)."""
ATTENTION = "attention"
"""The name ``Attention`` gives its output."""
SAVED = (QKV, ATTENTION)
"""What the ``names`` policy saves, MaxText's ``save_qkv_proj`` and ``save_out_proj`` together."""
POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "names": jax.checkpoint_policies.save_only_these_names(*SAVED),
}
"""What each ``--remat`` policy lets a checkpointed block save (None: no ``jax.checkpoint`` at
all)."""


def checkpointed(f: Callable[..., Any], policy: str) -> Callable[..., Any]:
    """``f`` wrapped in ``jax.checkpoint`` under ``POLICIES[policy]``; ``f`` itself for ``"none"``.

    Apply it per block, not around the whole model: the backward pass then
    recomputes one block at a time, so at most one block's intermediates are
    alive beside the kept inputs of all of them. That needs the recomputation to
    wait for the gradient it serves (``after_the_gradient``).
    """
    _checks.one_of("checkpointed: policy", policy, tuple(POLICIES))
    saveable = POLICIES[policy]
    return f if saveable is None else after_the_gradient(jax.checkpoint(f, policy=saveable))


def after_the_gradient(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` whose backward pass starts only once the gradient of its output exists.

    A block's recomputation depends on what its forward pass kept, not on the
    gradient, so a compiler may run it as early as the forward pass and keep its
    results until the backward pass: the memory that recomputation was to save.
    ``jax.checkpoint`` marks its recomputation with an optimization barrier, which
    XLA:TPU and XLA:GPU schedule by; XLA:CPU removes the barriers before it
    schedules (measured: a 4-block GPT kept every block's softmax under ``full``
    as under ``none``). Here the kept values are made to *depend* on the gradient
    (``+ 0 · g``, which no compiler folds away: ``0 · inf`` is not 0), so no
    compiler can recompute before the gradient arrives. The price: g's first
    number lives on one device, so where g is split the tie is a 4-byte all-reduce.
    """

    def forward(*args: Any) -> tuple[Any, Any]:
        return jax.vjp(f, *args)  # the output, and the backward pass holding what was kept

    def backward(pullback: Any, gradient: Any) -> Any:
        zero = 0 * jax.tree.leaves(gradient)[0].ravel()[0]

        def tied(kept: Any) -> Any:
            return kept + zero.astype(kept.dtype) if _floating(kept) else kept

        return jax.tree.map(tied, pullback)(gradient)

    wrapped = jax.custom_vjp(f)
    wrapped.defvjp(forward, backward)
    return wrapped


def _floating(x: Any) -> bool:
    return jax.numpy.issubdtype(x.dtype, jax.numpy.floating)


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """A training step's matmul FLOPs: ``model``, what the model needs (3 x its forward: MFU's
    numerator), and ``hardware``, what the step runs, recomputation included (HFU's)."""

    model: float
    hardware: float

    def utilization(self, seconds: float, peak: float) -> tuple[float, float]:
        """``(MFU, HFU)`` of a step that took ``seconds`` on devices of ``peak`` FLOP/s in all.

        >>> StepFlops(model=6e12, hardware=8e12).utilization(seconds=0.1, peak=1e14)
        (0.6, 0.8)
        """
        return self.model / (seconds * peak), self.hardware / (seconds * peak)


def step_flops(loss: Callable[..., Any], *args: Any) -> StepFlops:
    """Model and hardware FLOPs of a step on ``loss(*args) -> (value, metrics)`` (``losses.Loss``),
    counted from jaxprs, no compile.

    The hardware count reads the jaxpr of ``jax.value_and_grad``: the forward pass, then the
    backward, where ``jax.checkpoint``'s recomputed forward sits inside it.
    """
    hardware = matmul_flops(jax.make_jaxpr(jax.value_and_grad(loss, has_aux=True))(*args).jaxpr)
    return StepFlops(model_flops(loss, *args), hardware)


__all__ = [
    "ATTENTION",
    "POLICIES",
    "QKV",
    "SAVED",
    "StepFlops",
    "after_the_gradient",
    "checkpointed",
    "step_flops",
]
