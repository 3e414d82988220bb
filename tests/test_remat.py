"""Recomputation (``minishard.remat``): what each policy keeps, read from the compiled program, and what
it costs, counted from the jaxprs and read from XLA's ``cost_analysis``.

A stack of GPT blocks on one device: the compiled backward pass's temporaries grow per block by what
the block keeps (``memory.kept_by_policy``), and the step's matmuls by what it recomputes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minishard import memory, remat
from minishard.costs import Memory, matmul_flops
from minishard.models.gpt import GPT
from minishard.models.transformer import Block

B, S, WIDTH, HEADS, HIDDEN = 16, 256, 128, 4, 512  # the default GPT block at 256 characters
"""Large enough that activations, not the heap's packing of small buffers, set the peak."""
POLICIES = ("full", "names", "dots")


@functools.cache  # built op by op (jax.random): once per depth
def blocks(depth: int) -> tuple[Block, ...]:
    keys = jax.random.split(jax.random.key(0), depth)
    return tuple(Block(WIDTH, HEADS, HIDDEN, key=key, causal=True) for key in keys)


def stack_loss(wrap, stack, x):
    call = wrap(lambda block, x: block(x))
    for block in stack:
        x = call(block, x)
    return jnp.sum(jnp.sin(x)), ()  # (value, metrics): a Loss


def policy(name):
    return lambda f: remat.checkpointed(f, name)


X = jax.random.normal(jax.random.key(1), (B, S, WIDTH))
WRAPS = {name: policy(name) for name in ("none", *POLICIES)}
WRAPS["jax.checkpoint alone"] = lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)


@functools.cache
def compiled(wrap: str, depth: int):
    gradient = jax.jit(jax.grad(functools.partial(stack_loss, WRAPS[wrap]), has_aux=True))
    return gradient.lower(blocks(depth), X).compile()


def per_block(wrap: str) -> float:
    """The temporaries one more block adds to the compiled backward pass, in bytes."""
    return (Memory.of(compiled(wrap, 4)).temporaries - Memory.of(compiled(wrap, 2)).temporaries) / 2


@pytest.mark.parametrize("name", ["full", *(pytest.param(n, marks=pytest.mark.slow) for n in POLICIES[1:])])
def test_each_policy_keeps_per_block_what_the_formula_counts(name):
    predicted = 4 * memory.kept_by_policy(B, S, WIDTH, HEADS, WIDTH // HEADS, HIDDEN, 1, name)
    print(f"{name}: {per_block(name):,.0f} bytes per block compiled, {predicted:,} predicted")
    assert per_block(name) == pytest.approx(predicted, rel=0.01)


@pytest.mark.slow  # four compiles of their own
def test_without_after_the_gradient_xla_cpu_recomputes_early_and_keeps_it_all():
    """XLA:CPU drops ``jax.checkpoint``'s optimization barriers before it schedules: the recomputed
    forward runs with the forward pass and lives to the backward, as much as no remat keeps."""
    alone, full, none = (per_block(wrap) for wrap in ("jax.checkpoint alone", "full", "none"))
    assert alone > 0.9 * none and alone > 10 * full, (alone, full, none)


def test_every_policy_computes_the_gradients_of_none():
    stack = blocks(2)  # the programs per_block compiled and measured: run, not compiled again
    plain = compiled("none", 2)(stack, X)[0]
    for name in POLICIES:
        grads = compiled(name, 2)(stack, X)[0]
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max(), err_msg=name)


def test_hardware_flops_add_what_each_policy_recomputes():
    """full: every block's forward matmuls again but the MLP's second (its output feeds only the residual
    sum); names: the scores, their sum over values and the MLP's first; dots: none (all kept)."""
    stack = blocks(2)
    forward = matmul_flops(jax.make_jaxpr(lambda b, x: b(x))(stack[0], X).jaxpr)
    core = 2 * (2 * B * HEADS * S * S * (WIDTH // HEADS))  # q·k and the weights' sum over v
    mlp = 2 * B * S * WIDTH * HIDDEN  # each of the MLP's two matmuls
    recomputed = {"none": 0, "full": forward - mlp, "names": core + mlp, "dots": 0}
    for name, extra in recomputed.items():
        flops = remat.step_flops(functools.partial(stack_loss, WRAPS[name]), stack, X)
        assert flops.model == 3 * 2 * forward
        assert flops.hardware - flops.model == 2 * extra, name  # per block, two blocks
    full = remat.step_flops(functools.partial(stack_loss, WRAPS["full"]), stack, X)
    assert full.hardware / full.model == pytest.approx(1 + (forward - mlp) / (3 * forward))  # 1.25 here


@pytest.mark.slow  # reads the compiles of the tests above
@pytest.mark.parametrize("name", ("none", *POLICIES))
def test_xla_counts_the_matmuls_the_jaxpr_counts_plus_the_elementwise_work(name):
    stack = blocks(4)
    counted = remat.step_flops(functools.partial(stack_loss, WRAPS[name]), stack, X).hardware
    analysis = compiled(name, 4).cost_analysis()
    xla = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    print(f"{name}: XLA's flops / the jaxpr's matmuls {xla / counted:.3f}")
    assert 1.0 <= xla / counted <= 1.15


def test_a_policy_that_does_not_exist_is_refused_by_name():
    with pytest.raises(ValueError, match="GPT: remat must be a policy of none, full, dots, names, got True"):
        GPT(key=jax.random.key(0), remat=True)  # the old switch
    with pytest.raises(ValueError, match="checkpointed: policy must be one of"):
        remat.checkpointed(lambda x: x, "some")
