"""minishard.testing.attention: the cases it draws, and the arguments that would make it pass vacuously.

The properties it checks on real attentions (the ring, the gather, Ulysses) are in test_context.py.
"""

import functools

import jax
import pytest
from hypothesis import given, settings
from named import assert_named

import minishard as ms
from minishard import context as cx
from minishard.testing import SplitSequence, assert_attention_equivalent, split_sequences


@functools.cache
def seq_mesh(p, axis="seq"):
    return ms.make_mesh({axis: p}, devices=jax.devices()[:p])


ZIGZAG_2 = SplitSequence(seq_mesh(2), "seq", "zigzag", (1, 8, 1, 4))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: assert_attention_equivalent(
                cx.ring_attention, SplitSequence(seq_mesh(1), "seq", "zigzag", (1, 8, 1, 4)), causal=True
            ),
            "assert_attention_equivalent: the case's axis 'seq' has 1 device, which splits nothing",
        ),
        (
            lambda: SplitSequence(seq_mesh(2), "context", "zigzag", (1, 8, 1, 4)),
            "SplitSequence: axis='context' is no axis of the mesh {'seq': 2}",
        ),
        (
            lambda: SplitSequence(seq_mesh(2), "seq", "striped", (1, 8, 1, 4)),
            "SplitSequence: unknown chunk order 'striped'; choose from in-order, zigzag",
        ),
        (
            lambda: assert_attention_equivalent(cx.ring_attention, ZIGZAG_2, causal=True, rtol=-1e-5),
            "assert_attention_equivalent: rtol must be a finite number >= 0, got -1e-05",
        ),
        (
            lambda: assert_attention_equivalent(
                cx.ring_attention, ZIGZAG_2, causal=True, options={"window": 2}
            ),
            "assert_attention_equivalent: options={'window': 2} need a reference= that takes them",
        ),
        (
            lambda: split_sequences(orders=("bogus",)),
            "split_sequences: orders=('bogus',) names an unknown chunk order; "
            "choose from 'in-order', 'zigzag'",
        ),
        (
            lambda: split_sequences(chunk_lengths=(0,)),
            "split_sequences: chunk_lengths=(0,) must be positive ints (one at least)",
        ),
        (
            lambda: split_sequences(devices=(2,), min_seq_len=9),
            "split_sequences: min_seq_len=9, but the longest sequence these sizes make is 8 tokens",
        ),
    ],
)
def test_what_would_pass_vacuously_or_fail_deep_is_refused_by_name(call, message):
    assert_named(call, ValueError, [message])


@settings(max_examples=20, database=None)
@given(split_sequences(devices=(2, 4), chunk_lengths=(1, 2, 3), min_seq_len=8))
def test_min_seq_len_draws_only_long_enough_sequences(case):
    assert case.shape[1] >= 8 and case.shape[1] % (case.devices * cx.CHUNKS[case.order]) == 0


def test_a_failing_example_prints_its_case_with_named_arguments():
    one = {"devices": (2,), "orders": ("zigzag",), "chunk_lengths": (2,), "heads": (1,), "head_dims": (4,)}

    @settings(max_examples=1, database=None)
    @given(split_sequences(**one))
    def fails(case):
        raise AssertionError("found a bug")

    with pytest.raises(AssertionError) as failure:
        fails()
    printed = "".join("".join(getattr(failure.value, "__notes__", [])).split())  # hypothesis wraps lines
    assert "split_sequence(devices=2,order='zigzag',chunk_length=2,heads=1,head_dim=4,batch=1" in printed


def test_the_reference_is_given_causal_and_the_mask_options():
    seen = []

    def windowed_ring(q, k, v, *, axis, causal, order, window):  # a window it ignores: a stand-in
        return cx.ring_attention(q, k, v, axis=axis, causal=causal, order=order)

    def reference(q, k, v, *, causal, window):
        seen.append((causal, window))
        return cx.attention(q, k, v, causal=causal)

    for causal in (True, False):
        assert_attention_equivalent(
            windowed_ring, ZIGZAG_2, causal=causal, reference=reference, options={"window": 3}
        )
    assert seen == [(True, 3), (False, 3)]  # traced once each: each causal is its own compiled reference
