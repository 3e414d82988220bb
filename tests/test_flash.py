"""minishard.flash: the Pallas kernels, interpreted on the CPU (Pallas's plain interpreter): alone,
and as a ring's pairs of chunks (``flash_pairs``) on simulated devices, whose typed program is
lowered in its TPU interpreter too.

The oracle is ``context.attention`` (the one softmax attention): forward and gradients, float32.
Interpreted, each grid step costs milliseconds, so the shapes are tiny and the examples few:
16 to 32 tokens in blocks of 8 or 16, one or two of batch and of heads; heads of 8 (laid heads
first) or 128 (a tile of the lanes each, side by side).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

import minishard as ms
from minishard import context, flash
from minishard.composition import grouped_attention
from minishard.context import ring_attention
from minishard.models.gpt import GPT
from minishard.run.cli.models.transformer import ring_cores
from minishard.run.next_token import next_token_loss
from minishard.run.topology import tpu_devices
from minishard.sequence import over_sequence
from minishard.styles import mesh_rules

KEY = jax.random.key(0)


@functools.cache
def compiled(shape, blocks, causal, grad):
    """The jitted forward or gradient (of a weighted sum) of the kernel, and of the oracle."""

    def pair(fn):
        if not grad:
            return jax.jit(fn)
        return jax.jit(jax.grad(lambda q, k, v, g: jnp.sum(fn(q, k, v) * g), argnums=(0, 1, 2)))

    kernel = functools.partial(flash.flash_attention, block_q=blocks[0], block_k=blocks[1], interpret=True)
    return pair(functools.partial(kernel, causal=causal)), pair(
        functools.partial(context.attention, causal=causal)
    )


shapes = st.tuples(
    st.sampled_from([1, 2]), st.sampled_from([16, 32]), st.sampled_from([1, 2]), st.sampled_from([8, 128])
)


@settings(max_examples=6, deadline=None)
@given(
    shape=shapes,
    block_q=st.sampled_from([8, 16]),
    block_k=st.sampled_from([8, 16]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_the_kernel_is_attention_forward_and_backward(shape, block_q, block_k, causal, seed):
    q, k, v, g = jax.random.normal(jax.random.key(seed), (4, *shape))
    for grad in (False, True):
        mine, oracle = compiled(shape, (block_q, block_k), causal, grad)
        args = (q, k, v, g) if grad else (q, k, v)
        for got, want in zip(jax.tree.leaves(mine(*args)), jax.tree.leaves(oracle(*args))):
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_one_causal_case_forward_and_gradients():
    """The quick loop's case: 32 tokens, unequal blocks, so tiles cross the diagonal part way."""
    q, k, v, g = jax.random.normal(jax.random.key(0), (4, 1, 32, 1, 8))
    mine, oracle = compiled((1, 32, 1, 8), (16, 8), True, True)
    for got, want in zip(mine(q, k, v, g), oracle(q, k, v, g)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_bfloat16_in_float32_sums_is_within_bfloat16s_precision():
    q, k, v = jax.random.normal(jax.random.key(1), (3, 1, 32, 2, 128), jnp.bfloat16)  # side by side
    got = flash.flash_attention(q, k, v, causal=True, block_q=16, block_k=16, interpret=True)
    want = context.attention(q, k, v, causal=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_causal_share_is_n_plus_1_over_2n_for_square_blocks(n):
    assert flash.causal_share(n * 128, 128, 128) == (n + 1) / (2 * n)


def test_the_steps_that_run_are_the_ones_with_a_visible_key():
    """By brute force over positions: a step runs iff some key in its tile is visible to some query."""
    blocks, seq_len = (8, 16), 64
    for i in range(seq_len // blocks[0]):
        for j in range(seq_len // blocks[1]):
            q_pos = np.arange(i * blocks[0], (i + 1) * blocks[0])
            k_pos = np.arange(j * blocks[1], (j + 1) * blocks[1])
            seen = k_pos[None, :] <= q_pos[:, None]
            assert bool(flash.runs(i, j, blocks, True)) == seen.any()
            assert bool(flash.crosses(i, j, blocks)) == (not seen.all())


def test_a_skipped_step_copies_the_last_tile_that_ran():
    blocks = (8, 16)  # query block i's last query is 8i + 7: its last key block runs to (8i + 7) // 16
    assert [int(flash.key_tile(1, j, blocks, True)) for j in range(4)] == [0, 0, 0, 0]
    assert [int(flash.key_tile(2, j, blocks, True)) for j in range(4)] == [0, 1, 1, 1]
    assert [int(flash.query_tile(1, i, blocks, True)) for i in range(6)] == [2, 2, 2, 3, 4, 5]
    assert [int(flash.key_tile(0, j, blocks, False)) for j in range(4)] == [0, 1, 2, 3]


def test_merge_weights_is_the_share_of_each_denominator():
    w1, w2, lse = context.merge_weights(jnp.log(2.0), jnp.log(6.0))
    assert math.isclose(float(w1), 0.25, rel_tol=1e-6) and math.isclose(float(w2), 0.75, rel_tol=1e-6)
    assert math.isclose(float(lse), math.log(8.0), rel_tol=1e-6)


def error(**kwargs):
    x = jnp.zeros(kwargs.pop("shape", (1, 64, 2, 64)), kwargs.pop("dtype", jnp.float32))
    with pytest.raises(ValueError) as caught:
        flash.flash_attention(x, x, x, causal=True, **{"interpret": True, **kwargs})
    return str(caught.value)


def test_bad_input_is_one_line_naming_the_argument_and_what_would_work():
    assert error(block_q=24) == (
        "flash_attention: block_q=24 does not tile the sequence of 64 tokens; use a divisor of it that is a "
        "multiple of 8 (the TPU's sublanes) or 64 itself: 8, 16, 32, 64"
    )
    assert "block_k=12 does not tile" in error(block_k=12)
    assert error(shape=(1, 2048, 1, 64), block_q=1024, block_k=2048).startswith(
        "flash_attention: block_q x block_k = 1024 x 2048 makes a float32 score tile of 8 MiB"
    )
    assert error(shape=(1, 512, 1, 1024), block_q=512, block_k=512).startswith(
        "flash_attention: head_dim 1024 makes [512, 1024] tiles of 2 MiB"
    )
    assert error(block_q=32, interpret=False) == (
        "flash_attention: block_q=32: on a TPU the backward pass lays a query block's lse along the 128 "
        "lanes, so block_q is a multiple of 128 or the whole sequence (64): 64 (the interpreter takes any "
        "multiple of 8)"
    )
    assert error(interpret=False) == (
        "flash_attention: the Pallas kernel runs on a TPU, and this device is a cpu; pass interpret=True to "
        "run it here (slowly, as the tests do), or use minishard.context.attention"
    )
    assert all("\n" not in error(**bad) for bad in ({"block_q": 24}, {"interpret": False}))


def gpt_loss_and_grads(model, batch):  # module level: Sharded caches compiled code per function
    return jax.value_and_grad(next_token_loss, has_aux=True)(model, batch)


@pytest.mark.slow  # the kernels interpreted, in two programs
def test_the_gpt_with_the_flash_core_has_the_dense_loss_and_gradients_whole_and_sharded():
    """Whole, and under tp: the core's shard_map, each device the kernel on its heads. dp's is the
    same shard_map on its rows (the spec is the mesh's, ``flash_core``), a third program of the
    kernels compiled for no path of its own; that it runs the kernel on its own rows is
    test_under_dp_each_device_runs_the_kernel_on_its_own_rows_and_sends_what_dense_sends's."""
    ids = np.random.default_rng(0).integers(0, 11, (4, 17)).astype(np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    sizes = dict(vocab=11, context=16, width=32, depth=1, heads=4, kv_heads=2)  # grouped: K/V repeated

    def model(core):
        return GPT(**sizes, core=core, key=jax.random.key(0))

    whole = jax.jit(gpt_loss_and_grads)  # one program a core: op by op, the dense one took 4.7 s
    (want, _), want_grads = whole(model("dense"), batch)
    runs = {"whole": whole}
    shape, rules = mesh_rules("tp", 2)
    runs["tp"] = ms.Sharded(ms.make_mesh(shape, devices=jax.devices()[:2]), rules)(gpt_loss_and_grads)
    for style, run in runs.items():
        (loss, _), grads = jax.block_until_ready(run(model("flash-interpreted"), batch))
        assert float(loss) == pytest.approx(float(want), rel=1e-5), style
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def gpt_loss(model, batch):  # module level: Sharded caches compiled code per function
    return next_token_loss(model, batch)[0]


@pytest.mark.slow  # the kernels interpreted in a ring of 2 devices, forward only
def test_the_gpt_under_cp_with_flash_asked_attends_its_chunks_by_the_kernels_and_has_the_dense_loss():
    """cp's build makes the core "flash" a ring of the kernels (``RINGS``), and its loss is dense's.
    The loss alone: the ring of the kernels' gradients (the same causal zig-zag ring over 2 devices,
    grouped heads) are test_the_ring_with_flash_pairs_is_attention_forward_and_gradients's, a ring
    GPT's gradients test_gpt's test_under_dp_cp_the_ring_gpt_has_the_loss_and_gradients_of_dp."""
    ids = np.random.default_rng(0).integers(0, 11, (2, 17)).astype(np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    sizes = dict(vocab=11, context=16, width=32, depth=1, heads=4, kv_heads=2)  # chunks of 4 tokens
    want = jax.jit(gpt_loss)(GPT(**sizes, key=jax.random.key(0)), batch)  # op by op: 2.7 s
    model = ring_cores(GPT(**sizes, core="flash-interpreted", key=jax.random.key(0)))
    assert {block.attention.core for block in model.blocks} == {"ring-flash-interpreted"}
    shape, rules = mesh_rules("cp", 2)
    run = ms.Sharded(ms.make_mesh(shape, devices=jax.devices()[:2]), rules)(gpt_loss)
    assert float(run(model, batch)) == pytest.approx(float(want), rel=1e-5)


def test_cp_makes_each_core_a_ring_of_its_own_pairs():
    cores = {"dense": "ring", "flash": "ring-flash", "flash-interpreted": "ring-flash-interpreted"}
    for core, ring in cores.items():
        model = ring_cores(GPT(vocab=11, context=16, width=32, depth=2, heads=2, core=core, key=KEY))
        assert [block.attention.core for block in model.blocks] == [ring, ring]


@pytest.mark.slow  # two programs compile on 2 devices
def test_under_dp_each_device_runs_the_kernel_on_its_own_rows_and_sends_what_dense_sends():
    """A kernel XLA cannot split: without the core's shard_map it would gather the batch (measured:
    an all-gather of 32 kB and 7x the all-reduced bytes); with it, dp's gradient all-reduce alone."""
    ids = np.zeros((4, 17), np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    shape, rules = mesh_rules("dp", 2)
    step = ms.Sharded(ms.make_mesh(shape, devices=jax.devices()[:2]), rules)(gpt_loss_and_grads)
    sizes = dict(vocab=11, context=16, width=32, depth=1, heads=4)
    models = {core: GPT(**sizes, core=core, key=jax.random.key(0)) for core in ("dense", "flash-interpreted")}
    sent = {core: ms.census.bytes_by_mesh_axes(step.lower(model, batch)) for core, model in models.items()}
    assert sent["flash-interpreted"] == sent["dense"] and set(sent["dense"]) == {("all-reduce", ("data",))}


def test_the_flash_core_refuses_a_backend_it_cannot_run_on():
    model = GPT(vocab=11, context=16, width=32, depth=1, heads=2, core="flash", key=jax.random.key(0))
    with pytest.raises(ValueError, match="runs on a TPU, and this device is a cpu; pass interpret=True"):
        model(jnp.zeros((1, 16), jnp.int32))


@pytest.mark.slow  # XLA:TPU compiles three kernels
@pytest.mark.parametrize("head_dim", [64, 128])  # heads first, and side by side
def test_the_kernels_compile_for_a_tpu_as_mosaic_kernels(head_dim):
    """Nothing runs: XLA:TPU (libtpu) compiles the forward and backward for one v5e chip, here."""
    (chip,) = tpu_devices("v5e:1x1")
    x = jax.ShapeDtypeStruct((2, 1024, 2, head_dim), jnp.bfloat16, sharding=SingleDeviceSharding(chip))

    def loss(q, k, v):
        return jnp.sum(flash.flash_attention(q, k, v, causal=True, block_q=512, block_k=256))

    with jax.default_device(chip):  # Pallas lowers for the default device's TPU generation
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == 3  # forward, dk and dv, dq


@pytest.mark.tpu
@pytest.mark.parametrize(("context_length", "head_dim"), [(1024, 64), (1024, 128), (4096, 128)])
def test_on_the_chip_the_kernel_is_attention_at_the_chips_precision(context_length, head_dim):
    """The compiled kernel (no interpreter) against ``context.attention`` computed at float32's full
    precision on the MXU: bf16 inputs, each value and gradient within bf16's rounding of the largest."""
    q, k, v, g = jax.random.normal(jax.random.key(0), (4, 2, context_length, 4, head_dim), jnp.bfloat16)

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * g), argnums=(0, 1, 2)))

    kernel = functools.partial(flash.flash_attention, causal=True)
    with jax.default_matmul_precision("highest"):
        oracle = functools.partial(context.attention, causal=True)
        wide = [x.astype(jnp.float32) for x in (q, k, v)]
        want = [jax.jit(oracle)(*wide), *grads(oracle)(*wide)]
    got = [jax.jit(kernel)(q, k, v), *grads(kernel)(q, k, v)]
    for name, mine, exact in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        scale = float(jnp.max(jnp.abs(exact)))
        worst = float(jnp.max(jnp.abs(mine.astype(jnp.float32) - exact))) / scale
        assert worst < 2e-2, (name, worst)  # bf16 keeps 8 bits: 0.4% a value, sums of them more


# -- the ring, each pair of chunks by the kernels ------------------------------------------------
# The chapter's shard_map (``over_sequence``) types each value by the mesh axes it varies over; a
# ring's kernels then run in Pallas's TPU interpreter (``flash._pallas``), which calls back into
# Python at every load and store and meets every device at a barrier in each kernel call: compiling
# the [2-zigzag] ring's gradients took 20-60 s. Untyped (check_vma off) they run in the plain
# interpreter, the same kernel jaxprs as a loop of XLA ops: the numbers are checked there, and the
# typed ring's program (the TPU interpreter's, gradients included) is lowered, not run.
def ring_by_kernels(p, order, causal, pair_core, typed=True):
    """The ring on whole arrays in sequence order: ``sum(sin(out))`` and its gradients, jitted;
    ``typed``: in the chapter's ``over_sequence``, else in a shard_map with check_vma off."""
    mesh = ms.make_mesh({"seq": p}, devices=jax.devices()[:p])
    options = dict(causal=causal, order=order, pair_core=pair_core)
    if typed:
        ring = over_sequence(ring_attention, mesh, **options)
    else:
        attend = functools.partial(ring_attention, axis="seq", **options)
        spec = P(None, "seq")
        ring = jax.shard_map(attend, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)

    def loss(q, k, v):
        held = (context.permute(x, p, order) for x in (q, k, v))
        return jnp.sum(jnp.sin(context.permute(ring(*held), p, order, inverse=True)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def ring_inputs(p, order, chunk):
    """2 query heads on one K/V head, ``chunk`` tokens a chunk."""
    seq_len = chunk * p * context.CHUNKS[order]
    q = jax.random.normal(jax.random.key(0), (1, seq_len, 2, 8))
    k, v = jax.random.normal(jax.random.key(1), (2, 1, seq_len, 1, 8))
    return q, k, v


@pytest.mark.slow  # the kernels interpreted in a ring, forward and gradients
@pytest.mark.parametrize(
    ("p", "order", "causal", "chunk", "block"),
    # zigzag over 2 devices holds chunks 0, 3 and 1, 2: every kind of pair (diagonal, below, skipped)
    # and tiles across the diagonal; in order over 4, each device attends its own number of pairs
    [(2, "zigzag", True, 8, 8), (4, "in-order", False, 8, 8)],
)
def test_the_ring_with_flash_pairs_is_attention_forward_and_gradients(p, order, causal, chunk, block):
    """2 query heads on one K/V head: the kernels' pairs, merged and summed by the ring, are
    grouped attention, forward and gradients."""
    q, k, v = ring_inputs(p, order, chunk)
    dense = lambda q, k, v: jnp.sum(jnp.sin(grouped_attention(q, k, v, causal=causal)))  # noqa: E731
    want_loss, want = jax.jit(jax.value_and_grad(dense, argnums=(0, 1, 2)))(q, k, v)  # op by op: 1.2 s
    pairs = flash.flash_pairs(block_q=block, block_k=block, interpret=True)
    got_loss, got = jax.block_until_ready(ring_by_kernels(p, order, causal, pairs, typed=False)(q, k, v))
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=f"d{name}")


def test_in_the_chapters_typed_ring_the_kernels_and_their_gradients_lower_in_the_tpu_interpreter():
    """The ring as a model runs it (``over_sequence``, values typed by how they vary): each kernel's
    outputs vary as its q does, so the ring and its gradients type-check and lower, the kernels in
    Pallas's TPU interpreter (its calls back into Python); untyped, in its plain one (none).
    Zig-zag over 2 devices: the devices call the kernels alike, as the TPU interpreter's barriers
    need (in order, device i attends i + 1 pairs causally, and would wait for ever)."""
    q, k, v = ring_inputs(2, "zigzag", 8)
    pairs = flash.flash_pairs(block_q=8, block_k=8, interpret=True)
    callbacks = {
        typed: ring_by_kernels(2, "zigzag", True, pairs, typed).lower(q, k, v).as_text().count("callback")
        for typed in (True, False)
    }
    assert callbacks[True] > 0 and callbacks[False] == 0, callbacks


def test_a_chunk_the_blocks_cannot_tile_is_refused_in_one_line_before_the_ring_runs():
    x = jnp.zeros((1, 48, 2, 8))  # 4 devices, in order: chunks of 12 tokens
    pairs = flash.flash_pairs(block_q=8, block_k=8, interpret=True)
    with pytest.raises(ValueError) as caught:
        ring_by_kernels(4, "in-order", True, pairs)(x, x, x)
    assert str(caught.value) == (
        "flash_attend: block_q=8 does not tile the chunk of 12 tokens; use a divisor of it that is a "
        "multiple of 8 (the TPU's sublanes) or 12 itself: 12"
    )
