"""``explain --compare --size PUBLISHED --check``: a published run scaled to 8 devices, compiled.

``minishard.run.cli.scaled`` cuts the model (``scaled_down``), the layout (``scaled_layout``) and
the batch (``scaled_batch``); ``rank_check`` compiles the result as minishard's GPT and sets the
bytes each dimension sends beside the ranking's prediction for the same shapes. The rules are
checked without compiling; one slow test compiles Megatron-LM's layout, scaled (40-60 s on 2
shared cores), and one compiles it for a TPU v5e slice with XLA:TPU, ahead of time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import pytest

from minishard import context, layouts, serving
from minishard.costs import sent_bytes
from minishard.layouts import Layout
from minishard.precision import FP32
from minishard.run.cli import main, parse_args, rank_check
from minishard.run.cli.scaled import (
    DEVICES,
    WIDTH_CUT,
    as_built,
    entry_of,
    scaled_batch,
    scaled_down,
    scaled_layout,
)

PUBLISHED = {  # tests/test_published_runs.py's runs: chips, tokens a batch, sequence, layout
    "llama3-405b": (16384, 16 * 2**20, 8192, Layout(dp=128, tp=8, pp=16)),
    "palm-540b": (6144, 2048 * 2048, 2048, Layout(dp=2, fsdp=256, tp=12)),
    "megatron-1t": (3072, 3072 * 2048, 2048, Layout(dp=6, tp=8, pp=64)),
}


def embedding_share(size: serving.Decoder) -> float:
    return 2 * size.vocab * size.width / size.params


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_scaled_model_keeps_the_published_proportions(name: str) -> None:
    size = serving.SIZES[name]
    small = scaled_down(size)
    assert small.width * WIDTH_CUT == size.width and small.layers == 4
    assert small.hidden / small.width == size.hidden / size.width and small.gated == size.gated
    assert small.heads / small.kv_heads == size.heads / size.kv_heads  # the group of query heads
    # the key/value heads, if more than the devices, cut to as many (Megatron's 160 to 8), else kept
    assert small.kv_heads <= DEVICES and small.kv_heads in (size.kv_heads, DEVICES)
    assert small.heads * small.head_dim == small.width  # the GPT's attention: as wide as its stream
    # the embeddings keep their share of the parameters within 5% (PaLM: its attention 1.5x wider)
    assert embedding_share(small) / embedding_share(size) == pytest.approx(1, abs=0.05)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_built_gpt_has_the_parameters_its_prediction_prices(name: str) -> None:
    small = scaled_down(serving.SIZES[name])
    args = argparse.Namespace(context=64)
    model = jax.eval_shape(lambda: entry_of(small).build(args, jax.random.key(0)))
    built = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model))
    assert built == as_built(small, 64).params
    # the GPT adds a learned table of positions and its biases to the scaled shapes: under 1%
    assert 1 < built / small.params < 1.01


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_scaled_layout_shares_the_devices_doublings_as_the_published_one(name: str) -> None:
    layout = PUBLISHED[name][3]
    small = scaled_layout(layout)
    assert small.devices == DEVICES and set(small.ways()) <= set(layout.ways())
    # each dimension gets its share of log2(8) = 3 doublings, to within one
    for dimension, ways in layout.ways().items():
        share = 3 * math.log2(ways) / math.log2(layout.devices)
        assert abs(math.log2(small[dimension]) - share) < 1


def test_meta_s_layout_scaled_is_one_doubling_each() -> None:
    # dp 128 x tp 8 x pp 16: 7, 3 and 4 of 14 doublings; of 3, 1.5, 0.64 and 0.86: dp takes
    # one whole, pp and tp the two left by their remainders (0.86, 0.64 over dp's 0.5)
    assert scaled_layout(Layout(dp=128, tp=8, pp=16)) == Layout(dp=2, tp=2, pp=2)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_scaled_batch_keeps_the_tokens_a_device(name: str) -> None:
    devices, tokens, context, _ = PUBLISHED[name]
    small, sequence = scaled_batch(tokens, devices, context)
    assert sequence == context // WIDTH_CUT and small % (sequence * DEVICES) == 0
    assert abs(small / DEVICES - tokens / devices) < sequence  # within a sequence a device


MEGATRON = ["explain", "--compare", "--size", "megatron-1t", "--hardware", "a100",
            "--devices", "3072", "--batch-size", "6M", "--context", "2048"]  # fmt: skip
GPT = ["explain", "--compare", "--size", "gpt", "--hardware", "v5p", "--batch-size", "1K"]
SCALED_FLAGS = [
    ([*MEGATRON[:-2], "--context", "16", "--check"],
     "argument --context: --check cuts the sequence by 32; 16 leaves none"),
    ([*MEGATRON, "--check", "--topology", "v5e:4x4"],
     "argument --topology: --check compiles on 8 devices; v5e:4x4 is 16"),
    ([*MEGATRON, "--check", "--topology", "v7:2x4"],
     "argument --topology: topology 'v7:2x4': unknown TPU"),
    ([*GPT, "--check", "--topology", "v5e:2x4"],
     "argument --topology: v5e:2x4's chips are v5e, not --hardware v5p"),
    ([*MEGATRON, "--topology", "v5e:2x4"], "argument --topology: --compare --size ranks layouts"),
    (["explain", "--compare", "--hardware", "v5p", "--check"],
     "argument --check: only with --compare --size"),
]  # fmt: skip


FLAG_IDS = [" ".join(argv[-3:]) for argv, _ in SCALED_FLAGS]


@pytest.mark.parametrize(("argv", "message"), SCALED_FLAGS, ids=FLAG_IDS)
def test_a_scaled_check_refuses_bad_input_before_any_compile(argv, message, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled before the flags were checked")

    monkeypatch.setattr(rank_check, "compile_layout", refuse)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and message in err and out == "", err


def compiled_megatron(topology: str | None = None) -> rank_check.Checked:
    """Megatron-LM's dp 6 x tp 8 x pp 64, scaled: dp 2 x tp 2 x pp 2, compiled (XLA:CPU's, or
    the slice's)."""
    args = parse_args([*MEGATRON, "--check", "1", *(["--topology", topology] if topology else [])])
    own, built = rank_check.scaled_run(args)
    layout = scaled_layout(PUBLISHED["megatron-1t"][3])
    made = rank_check.composition(layout)
    assert not isinstance(made, str) and made[0] == "dp+tp+pp"
    return rank_check.compile_layout(own, layout, *made, built)


def assert_the_megatron_sends(row: rank_check.Checked) -> None:
    # dp: each of 2 replicas all-reduces the gradients of what a device holds, 2 x 1/2 of their
    # bytes; predicted: of 4 P / tp / pp, which a stage exceeds by 1% (its embedding and head whole)
    assert row.sent["dp"] == pytest.approx(row.parameters, rel=1e-3)
    assert row.expected["dp"] == pytest.approx(rank_check.FLOAT32 * row_size().params / 4)
    assert row.sent["dp"] / row.expected["dp"] == pytest.approx(1, abs=0.02)
    # pp: the prediction splits a stage's output over tp (sp's); tp beside pp has no sp
    # (rank_check.composition), so each tick sends the whole residual stream: tp = 2 times
    assert row.sent["pp"] / row.expected["pp"] == pytest.approx(row.predicted.layout["tp"], rel=0.02)


@pytest.mark.slow
def test_megatron_s_layout_scaled_compiles_to_the_predicted_bytes_but_pp_s() -> None:
    row = compiled_megatron()
    assert set(row.sent) == {"dp", "tp", "pp"}
    assert_the_megatron_sends(row)
    # tp: without sp (beside pp) a block all-reduces its output forward and its input's gradient
    # backward, 2 all-reduces of the stream, where sp is priced at the forward's gather and
    # reduce-scatter and the backward's twice, 3 all-reduces' bytes: 2/3, the bubble's ticks
    # counted on both sides (every_tick: 5 ticks for 4 microbatches; without them, 0.83)
    assert row.sent["tp"] / row.expected["tp"] == pytest.approx(2 / 3, rel=0.01)
    assert row.predicted.layout == Layout(dp=2, tp=2, pp=2)
    expected = layouts.bytes_sent(row_size(), row.predicted.layout, 256 * 64, 4, 64, 4)
    assert row.expected == pytest.approx(expected)


def row_size() -> serving.Decoder:
    return as_built(scaled_down(serving.MEGATRON_1T), 64)


def one_layer(
    own: argparse.Namespace, built: rank_check.Built, name: str
) -> tuple[argparse.Namespace, rank_check.Built]:
    """The scaled run of ``name`` at one of its 4 layers: each layer sends what every layer does, and
    the prediction counts the layers it is given; the compile a third to a half of the 4 layers'."""
    small = dataclasses.replace(scaled_down(serving.SIZES[name]), layers=1)
    one = rank_check.Built(entry_of(small), as_built(small, own.context), built.devices)
    return argparse.Namespace(**{**vars(own), "depth": 1}), one


@pytest.mark.slow
def test_on_a_v5e_slice_xla_tpu_gathers_fsdp_s_weights_more_often_than_predicted() -> None:
    # XLA:TPU, ahead of time (libtpu, no chip): fsdp 8 of the scaled Megatron-LM, 2-5 minutes on 2
    # busy cores. The parameters are split as predicted, to the byte; the bytes fsdp sends are 1.78x
    # the prediction's gather, gather and reduce-scatter of each weight: XLA:TPU gathers weights
    # again where each is used and reshards activations with all-to-alls over "data" (docs/tpu.md's
    # table shows the same of the GPT's fsdp step), which XLA:CPU does not (1.00, docs/compose.md).
    # Here at 8 sequences a step, not compose.md's 256 (batch 192K, not 6M): the same weights, and
    # 1.81 (768K: 1.95), its compile a quarter of 256's (31 s against 130 s, back to back); and at
    # one of the 4 layers (one_layer): 1.87, its compile 12 s against 22 s, back to back
    small_batch = [*MEGATRON[:-3], "192K", *MEGATRON[-2:]]  # --batch-size 192K
    args = parse_args([*small_batch, "--check", "1", "--topology", "v5e:2x4"])
    own, built = one_layer(*rank_check.scaled_run(args), "megatron-1t")
    assert own.hardware == "v5e" and built.devices[0].platform == "tpu" and own.batch_size == 8 * 64
    layout = Layout(fsdp=DEVICES)
    row = rank_check.compile_layout(own, layout, "fsdp", {"data": DEVICES}, built)
    split = rank_check.FLOAT32 * built.size.params / DEVICES
    assert row.parameters == pytest.approx(split, rel=1e-3)
    assert set(row.sent) == {"fsdp"}
    assert row.sent["fsdp"] / row.expected["fsdp"] == pytest.approx(1.87, abs=0.1)


@pytest.mark.slow
def test_llama_s_ring_sends_its_grouped_keys_and_values_at_their_own_heads() -> None:
    # LLaMA-3 405B scaled: 128 query heads share 8 key/value heads. The ring sends the 8, repeated
    # for the queries where they arrive (context.repeated); the ranking prices Llama 3's
    # all-gather of them: the ring's sum(ring_permutes(8)) = 44 chunks of K or V against the
    # gather's and reduce-scatter's 4 x 7, 1.57 times. cp's devices all-reduce the gradients over
    # "context" as predicted. (Before issue 63's ring sent the 128 query heads' copies and the
    # ranking priced no all-reduce: 31.2 times the prediction, docs/compose.md.)
    llama = ["explain", "--compare", "--size", "llama3-405b", "--hardware", "h100", "--check", "1",
             "--devices", "16384", "--batch-size", "16M", "--context", "8192"]  # fmt: skip
    own, built = rank_check.scaled_run(parse_args(llama))
    assert built.size.gated and built.size.heads // built.size.kv_heads == 16 and own.context == 256
    own, built = one_layer(own, built, "llama3-405b")  # each layer's ring and all-reduces alike
    size = built.size
    layout = Layout(cp=DEVICES)
    row = rank_check.compile_layout(own, layout, "cp", {"context": DEVICES}, built)
    # cp splits no weight but the learned table of positions, over "context" (its "seq" rows)
    held = size.params - size.position_rows * size.width * (DEVICES - 1) / DEVICES
    assert row.parameters == pytest.approx(rank_check.FLOAT32 * held, rel=1e-3)
    found = layouts.sends(size, layout, own.batch_size, rank_check.FLOAT32, own.context)
    sent = [(sent_bytes(s.kind, s.result_bytes, DEVICES), s.of_weights) for s in found]
    keys_and_values = sum(n for n, of_weights in sent if not of_weights)
    gradients = sum(n for n, of_weights in sent if of_weights)
    ring = sum(context.ring_permutes(DEVICES)) / (4 * (DEVICES - 1))
    # beside them the learned table of positions, split over "context" and gathered whole once a
    # step: (p - 1)/p of its bytes (0.4% of the 4 layers' sends, 1.5% of one's); the rest, 917 B
    table = sent_bytes("all-gather", rank_check.FLOAT32 * size.position_rows * size.width, DEVICES)
    assert row.sent["cp"] == pytest.approx(ring * keys_and_values + gradients + table, rel=1e-3)


def test_a_published_size_s_check_tries_its_scaled_run_then_its_layout(capsys, monkeypatch):
    tried = []

    def refuse(args, layout, name, shape, built=None):  # no compile: what was asked, then a refusal
        tried.append((layout, name, args.devices, args.batch_size, args.context, built.size))
        raise ValueError("not compiled here")

    monkeypatch.setattr(rank_check, "compile_layout", refuse)
    assert main([*MEGATRON, "--layout", "dp=6,tp=8,pp=64", "--check", "2"]) == 0
    out = capsys.readouterr().out.split("\n--check 2: ")[1]
    small = as_built(scaled_down(serving.MEGATRON_1T), 64)
    header = "megatron-1t scaled down to 8 devices of a100, compiled (float32, XLA:CPU)"
    assert out.startswith(header)
    assert f"{small.params:,} parameters" in out and "256 sequences of 64 tokens a step" in out
    compiled = rank_check.compiled_kept(argparse.Namespace())  # float32, nothing recomputed
    assert compiled == layouts.Kept(precision=FP32, remat="none")
    ranking = layouts.rank(small, 256 * 64, 8, "a100", 64, kept=compiled)  # ranked as compiled
    fastest = [cost.layout for cost in ranking.costs if cost.fits]
    building = [layout for layout in fastest if not isinstance(rank_check.composition(layout), str)]
    # each that builds is tried (none compiles here), then the published layout, scaled
    assert [row[0] for row in tried] == [*building, Layout(dp=2, tp=2, pp=2)]
    assert {row[2:] for row in tried} == {(DEVICES, 256 * 64, 64, small)}
    assert "--layout dp 6 x tp 8 x pp 64, scaled:" in out
    assert "skipped, --parallel dp+tp+pp refuses" in out
