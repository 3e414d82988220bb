"""The memory chapter against XLA:TPU's own ``memory_analysis()``, compiled ahead of time here.

libtpu compiles ``train``'s step for one v5e chip (``--topology v5e:1x1``) on this machine: its
buffer assignment is the chip's, so ``explain --memory``'s prediction (``memory.kept_on_tpu``'s
terms) is checked against it without a chip (docs/tpu.md, "On a real chip"; numbers from
``benchmarks/memory_aot.py``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("libtpu", reason="XLA:TPU compiles ahead of time only where libtpu is installed")

from minishard import memory
from minishard.costs import Memory
from minishard.run.cli import parse_args
from minishard.run.cli.memory import compiled_memory, compiler_of, predict

SIZES = {
    "6x384": ["--depth", "6", "--width", "384", "--heads", "6", "--context", "256", "--batch-size", "64"],
    "2x384": ["--depth", "2", "--width", "384", "--heads", "6", "--context", "256", "--batch-size", "64"],
    "12x768": ["--depth", "12", "--width", "768", "--heads", "12", "--context", "1024", "--batch-size", "16"],
}
ON_A_V5E = ["explain", "--memory", "--model", "gpt", "--topology", "v5e:1x1"]


def predicted_and_compiled(flags: list[str]) -> tuple[memory.Budget, Memory]:
    args = parse_args([*ON_A_V5E, *flags])
    budget, step_args, shape, rules = predict(args)
    return budget, compiled_memory(args, step_args, shape, rules, args.topology_devices)


def test_a_topology_predicts_what_xla_tpu_keeps_not_what_xla_cpu_keeps():
    """Under --topology the activations are kept_on_tpu's: 6 x 384 keeps 0.6 of XLA:CPU's in fp32."""
    args = parse_args([*ON_A_V5E, *SIZES["6x384"]])
    assert compiler_of(args) == "xla:tpu"
    tpu = predict(args)[0].terms["activations"]
    cpu = predict(parse_args(["explain", "--memory", "--model", "gpt", "--devices", "1", *SIZES["6x384"]]))
    assert compiler_of(parse_args(["explain", "--model", "gpt", "--devices", "1"])) == "xla:cpu"
    b, s, width, heads, hidden = 64, 256, 384, 6, 4 * 384
    block = 2 * b * s * width * 4 + 4 * b * s * width * 2 + b * heads * s * s * 4 + b * s * hidden * 4
    head = (2 * b * s * width + b * s * 65) * 4  # the last norm's input and output, the logits
    assert tpu == 6 * block + head
    assert 0.55 < tpu / cpu[0].terms["activations"] < 0.65


def test_xla_tpu_keeps_the_softmax_in_the_steps_dtype_and_q_k_v_in_bfloat16_whatever_the_precision():
    """The softmax's weights in bf16 in a bf16 step (``context.narrow_attend``; float32's before:
    XLA:TPU's 6 x 384 step keeps 1,080 MB, 1,391 MB before); under ``dots``, the scores, in the
    step's dtype too (``context.scores``: float32 before, 1.23 predicted over compiled at 6 x 384 in
    bf16, 1.02 after)."""
    b, s, width, heads, hidden = 16, 1024, 768, 12, 3072
    fp32, bf16 = (
        memory.kept_on_tpu(b, s, width, heads, width // heads, hidden, dtype, "none")
        for dtype in ("float32", "bfloat16")
    )
    assert fp32["softmax"] == 2 * bf16["softmax"] == 4 * b * heads * s * s
    dots = memory.kept_on_tpu(b, s, width, heads, width // heads, hidden, "bfloat16", "dots")
    assert dots["scores"] == 2 * b * heads * s * s and "softmax" not in dots
    assert fp32["q, k, v, out"] == bf16["q, k, v, out"] == 2 * 4 * b * s * width
    assert fp32["stream"] == 2 * bf16["stream"]
    full = memory.kept_on_tpu(b, s, width, heads, width // heads, hidden, "bfloat16", "full")
    assert full == {"input": 2 * b * s * width}


def test_under_grouped_queries_a_topology_keeps_k_and_v_at_their_heads():
    """2 K/V heads of 6: XLA:TPU's 6 x 384 bf16 step keeps 98.6 MB fewer temporaries (compiled here
    ahead of time, docs/tpu.md); the prediction, its six blocks' k and v at 2 heads, 100.7 MB."""
    six, two = (
        predict(parse_args([*ON_A_V5E, *SIZES["6x384"], "--precision", "bf16", "--kv-heads", kv]))[0]
        for kv in ("6", "2")
    )
    b, s, head_dim = 64, 256, 64
    fewer = 6 * 2 * b * s * (6 - 2) * head_dim * 2  # six blocks' k and v, 4 heads fewer, in bf16
    assert six.terms["activations"] - two.terms["activations"] == fewer
    assert 0.95 < fewer / 98.6e6 < 1.05  # what XLA:TPU keeps fewer


@pytest.mark.tpu  # a compile of 6 x 384 (20-60 s here)
def test_grouped_queries_are_predicted_within_15_percent():
    predicted, compiled = predicted_and_compiled([*SIZES["6x384"], "--precision", "bf16", "--kv-heads", "2"])
    assert 0.85 <= predicted.temporaries / compiled.temporaries <= 1.15, predicted.table(compiled)


IN_THE_SUITE = ("2x384", "fp32", "none")
"""One compile in ``make test``: the chapter's claim, within 15% (1.00), of 6 x 384's first case cut to
2 of its blocks (XLA:TPU's compile here is mostly a fixed cost: 75-82 s against 96 s at 6 blocks
on a loaded machine; 6 x 384's 40 s in the suite). The table's eight, the known gaps among them, run
where XLA:TPU compiles in seconds, on the chip (``make test-tpu``), and ``benchmarks/memory_aot.py``
prints them all."""
KNOWN_GAPS = {("6x384", "bf16", "full"): 1.67, ("6x384", "bf16", "names"): 1.28}
"""Over 15%, measured (docs/tpu.md): each gap is about the chip's VMEM (``VMEM``). XLA:TPU's
memory-space assignment fills it in every case of 6 x 384 (115-118 MB, ``memory_aot.py --terms``),
and the HBM temporaries count none of it. Under ``full`` and ``names`` in bf16 it holds 117.3 and
115.2 MB of buffers the chapter's terms count: the gaps are 132.9 and 128.9 MB (the ratios 1.08
and 1.03 with that share counted as held). In the other cases the terms, read from XLA:TPU's HBM
peak, agree without it; at GPT-2 small the share is 1.5% of the temporaries."""
VMEM = 128 * 2**20
"""A TPU v5e's vector memory (the scaling book's TPU chapter: 128 MiB)."""
CASES = [
    pytest.param(*IN_THE_SUITE, id="-".join(IN_THE_SUITE), marks=pytest.mark.slow),
    *(
        pytest.param(size, precision, policy, id=f"{size}-{precision}-{policy}", marks=pytest.mark.tpu)
        for size in ("6x384",)
        for precision in ("fp32", "bf16")
        for policy in memory.TPU_KEEPS
    ),
]


@pytest.mark.parametrize(("size", "precision", "policy"), CASES)
def test_predicted_temporaries_are_xla_tpus_within_15_percent(size, precision, policy):
    """20-60 s a compile here; 12 x 768's take minutes (``benchmarks/memory_aot.py`` runs them)."""
    flags = [*SIZES[size], "--precision", precision, "--remat", policy]
    predicted, compiled = predicted_and_compiled(flags)
    ratio = predicted.temporaries / compiled.temporaries
    print(f"{size} {precision} remat={policy}: predicted / XLA:TPU's temporaries {ratio:.2f}")
    if (gap := KNOWN_GAPS.get((size, precision, policy))) is not None:
        assert abs(ratio - gap) <= 0.05, predicted.table(compiled)  # the gap at its documented size
        assert predicted.temporaries - compiled.temporaries <= VMEM  # no more than VMEM could hold
    else:
        assert 0.85 <= ratio <= 1.15, predicted.table(compiled)
    assert abs(predicted.arguments - compiled.arguments) < 0.01 * compiled.arguments  # its tile padding


@pytest.mark.tpu  # minutes here: XLA:TPU compiles GPT-2 small's body (36 s on the chip)
def test_gpt2_smalls_body_in_bf16_is_predicted_within_15_percent():
    """The issue's case: 13.57 GB of temporaries on the chip, 10.6 GB predicted before kept_on_tpu."""
    predicted, compiled = predicted_and_compiled([*SIZES["12x768"], "--precision", "bf16"])
    assert 0.85 <= predicted.temporaries / compiled.temporaries <= 1.15, predicted.table(compiled)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "documented"),
    [pytest.param("fp32", 2.68, marks=pytest.mark.tpu), ("bf16", 1.77)],  # one compile in the suite
)
def test_the_default_gpts_step_lives_in_vmem_off_by_the_documented_ratio(precision, documented):
    """A known gap (docs/memory.md): the default GPT's live set, ~20 MB, fits the v5e's 128 MiB of
    VMEM, where XLA:TPU's memory-space assignment places most of it; its HBM temporaries are ~10 MB
    under every policy, which the chapter's terms do not model (bf16: 2.08 before the terms kept
    the softmax in bf16, ``context.narrow_attend``; 1.82 before the scores came out in bf16)."""
    predicted, compiled = predicted_and_compiled(["--precision", precision])
    ratio = predicted.temporaries / compiled.temporaries
    assert 0.85 * documented <= ratio <= 1.15 * documented, predicted.table(compiled)
