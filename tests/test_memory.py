"""minishard.memory against the published tables, JAX's saved residuals and the compiler."""

from __future__ import annotations

import pytest

from minishard import memory as mm
from minishard.memory import FP32, MIXED, Precision, bytes_per_parameter, zero_bytes

GB = 1e9


# --- the published tables ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("billions", "plain", "accumulated"),
    [(1, 16, 20), (7, 112, 140), (70, 1120, 1400), (405, 6480, 8100)],
)
def test_the_playbooks_table(billions, plain, accumulated):
    """The Ultra-Scale Playbook: mixed precision with AdamW, parameters + gradients + optimizer state;
    then with the gradients accumulated in float32."""
    with_fp32_grads = Precision("bfloat16", "bfloat16", master="float32", accumulated="float32")
    assert billions * 1e9 * sum(bytes_per_parameter(MIXED, "adamw").values()) / GB == plain
    assert billions * 1e9 * sum(bytes_per_parameter(with_fp32_grads, "adamw").values()) / GB == accumulated


@pytest.mark.parametrize(
    ("precision", "whole", "replicated", "split"),
    [
        (Precision("float16", "float16", master="float32", accumulated="float32"), 20, 4, 16),
        (Precision("bfloat16", "float32", master="float32"), 18, 6, 12),
        (FP32, 16, 8, 8),
    ],
)
@pytest.mark.parametrize("d", [1, 2, 4, 8, 64])
def test_megatrons_distributed_optimizer_table(precision, whole, replicated, split, d):
    """Megatron-LM's docs: bytes per parameter over d data-parallel ranks, the optimizer's state split."""
    terms = bytes_per_parameter(precision, "adamw")
    assert sum(terms.values()) == whole
    assert zero_bytes(terms, 1, d) == pytest.approx(replicated + split / d)


@pytest.mark.parametrize("n", [1, 4, 64, 1024])
def test_zeros_three_stages(n):
    """ZeRO's paper (fp16 parameters and gradients, K = 12): per device, Ψ = 1."""
    terms = bytes_per_parameter(Precision("float16", "float16", master="float32"), "adamw")
    k = terms["master"] + terms["moments"]
    assert k == 12
    assert zero_bytes(terms, 0, n) == 2 + 2 + k
    assert zero_bytes(terms, 1, n) == pytest.approx(2 + 2 + k / n)
    assert zero_bytes(terms, 2, n) == pytest.approx(2 + (2 + k) / n)
    assert zero_bytes(terms, 3, n) == pytest.approx((2 + 2 + k) / n)


def test_sgd_keeps_one_moment_with_momentum_and_none_without():
    assert bytes_per_parameter(FP32, "momentum")["moments"] == 4
    assert bytes_per_parameter(FP32, "sgd")["moments"] == 0


# --- the activation formula ------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_minishards_block_is_the_papers_without_dropout(t):
    """In 16-bit bytes, minishard's block keeps the paper's sbh(34 + 5as/h) less its dropout: 2sbh of
    masks after attention and the MLP, and the softmax's dropout mask and output, 3as²b; tensor
    parallel over t the same, from sbh(10 + 24/t + 5as/(ht)); with sequence parallelism all of it / t."""
    s, b, h, a = 2048, 1, 4096, 32
    heads, hidden = a // t, 4 * h // t
    ours = 2 * mm.block_activations(b, s, h, heads, h // a, hidden)
    masks, softmax_dropout = 2 * s * b * h, 3 * a * s * s * b / t
    assert ours == mm.korthikanti(s, b, h, a, t) - masks - softmax_dropout
    split = 2 * mm.block_activations(b, s, h, heads, h // a, hidden, sp=t)
    assert split == pytest.approx(mm.korthikanti(s, b, h, a, t, sp=True) - (masks + 3 * a * s * s * b) / t)
    selective = 2 * mm.block_activations(b, s, h, heads, h // a, hidden, sp=t, recompute="selective")
    paper = mm.korthikanti(s, b, h, a, t, sp=True, recompute="selective")
    assert selective == pytest.approx(paper - masks / t)
    full = 2 * mm.block_activations(b, s, h, heads, h // a, hidden, sp=t, recompute="full")
    assert full == mm.korthikanti(s, b, h, a, t, sp=True, recompute="full")


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: Precision("float8"), "Precision: params"),
        (lambda: Precision(master="int8"), "Precision: master"),
        (lambda: bytes_per_parameter(FP32, "adam"), "bytes_per_parameter: optimizer"),
        (lambda: zero_bytes({}, 4, 8), "zero_bytes: stage"),
        (lambda: zero_bytes({}, 1, 0), "zero_bytes: devices"),
        (lambda: mm.block_activations(1, 1, 1, 1, 1, 1, recompute="dots"), "block_activations: recompute"),
    ],
)
def test_bad_input_is_one_line_naming_the_argument(call, says):
    with pytest.raises(ValueError, match=says) as caught:
        call()
    assert "\n" not in str(caught.value)
