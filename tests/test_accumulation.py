"""Gradient accumulation meets dp and fsdp: how many gradient reductions and weight gathers one step
makes with M microbatches, read from the compiled programs: XLA:CPU's here, XLA:TPU's ahead of time.

The step is ``train --microbatches 4``'s: ``pipeline.microbatched``, a ``lax.scan`` over the slices of
the batch, summing the gradients. Whether a collective runs once per step or once per microbatch is
the compiler's choice, and the two compilers choose differently (docs/compose.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from minishard import AdamW, Sharded, make_mesh
from minishard.models.gpt import GPT
from minishard.run.next_token import next_token_loss
from minishard.run.steps import make_train_step
from minishard.run.topology import compile_for, tpu_devices
from minishard.styles import mesh_rules

CONTEXTS = {"dp": 16, "fsdp": 64}
"""dp's GPT attends 16 tokens: XLA:TPU leaves the position table's reduction inside dp's loop (8 kB
a microbatch), about 3% of one block's bytes (at 64 tokens, 32 kB: 11%, which took four blocks and
two times longer compiles). fsdp's keeps 64: at 16, XLA:CPU reshards with all-to-alls in the loop."""


@functools.cache
def sent(style: str, microbatches: int, topology: str | None = None) -> dict[str, int]:
    """Bytes each kind of collective sends in one step (per device, loop trips counted), of a GPT of
    one block: whether a gradient is reduced, or a weight gathered, once or per microbatch does not
    depend on how many blocks there are. 8 sequences per device, 2 per microbatch of 4."""
    shape, rules = mesh_rules(style, 8)
    mesh = make_mesh(shape, devices=tpu_devices(topology) if topology else jax.devices()[:8])
    context = CONTEXTS[style]
    model, optimizer = GPT(context=context, depth=1, key=jax.random.key(0)), AdamW(1e-3)
    windows = jnp.zeros((64, context), jnp.int32)
    step = Sharded(mesh, rules)(make_train_step(optimizer, next_token_loss, microbatches=microbatches))
    program = compile_for(step.lower(model, optimizer.init(model), {"inputs": windows, "targets": windows}))
    return {kind: found.bytes for kind, found in program.collectives.items()}


def test_xla_cpu_reduces_every_microbatchs_gradients_under_dp():
    once, accumulated = sent("dp", 1), sent("dp", 4)
    assert accumulated["all-reduce"] == 4 * once["all-reduce"], (once, accumulated)


@pytest.mark.slow  # two more compiles
def test_xla_cpu_gathers_fsdps_weights_once_but_reduces_per_microbatch():
    """The gathered weights do not change inside the loop: XLA:CPU hoists their all-gathers out of it
    (and keeps every gathered weight alive through it); the gradients' reductions stay inside."""
    once, accumulated = sent("fsdp", 1), sent("fsdp", 4)
    assert accumulated["all-gather"] == once["all-gather"], (once, accumulated)
    assert accumulated["all-reduce"] == pytest.approx(4 * once["all-reduce"], rel=0.01), (once, accumulated)


@pytest.mark.slow  # four XLA:TPU compiles, ~15 s each
def test_xla_tpu_reduces_dps_gradients_once_but_gathers_fsdps_weights_per_microbatch():
    """XLA:TPU moves dp's all-reduce out of the loop (one reduction of the summed gradients), and under
    fsdp gathers every weight again for each microbatch: 4x the bytes (NVIDIA/cosmos-framework#161)."""
    dp = {m: sent("dp", m, "v5e:2x4") for m in (1, 4)}
    assert dp[4]["all-reduce"] <= 1.05 * dp[1]["all-reduce"], dp
    fsdp = {m: sent("fsdp", m, "v5e:2x4") for m in (1, 4)}
    assert fsdp[4]["all-gather"] == pytest.approx(4 * fsdp[1]["all-gather"], rel=0.05), fsdp
    assert fsdp[4]["reduce-scatter"] == pytest.approx(4 * fsdp[1]["reduce-scatter"], rel=0.05), fsdp
