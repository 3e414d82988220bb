"""The inference roofline (minishard.serving) against the scaling book's inference chapter.

Oracles (jax-ml/scaling-book, ``inference.md``): the LLaMA-2 13B table on 8 TPU v5e and
the pop quiz. Every figure is recomputed from serving's functions and hardware.py's chips.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import pytest

from minishard import serving
from minishard.hardware import HARDWARE, hardware_named
from minishard.models.gpt import GPT
from minishard.run.cli import decode, main
from minishard.run.cli.sample import decoder, per_device

BATCHES = (1, 8, 16, 32, 64, 240)
BOOK_STEP_MS = (4.98, 12.13, 20.30, 36.65, 69.33, 249.09)
BOOK_TOKENS_PER_S = (200.61, 659.30, 787.99, 873.21, 923.13, 963.53)
# The book's table is computed from rounded figures: 13e9 parameters (26 GB in bf16), a cache of
# 6.7 GB per sequence, and 0.82e12 B/s of HBM per chip ("0.82TiB/s each", under the table); its
# tpus.md chapter and its pop quiz, like hardware.py, use 8.1e11. That is the whole difference.
BOOK_V5E = dataclasses.replace(HARDWARE["v5e"], hbm_bandwidth=8.2e11)


def test_kv_cache_of_llama2_13b_is_6_71e9_bytes_that_is_6_25_gib() -> None:
    per_sequence = serving.LLAMA2_13B.kv_bytes_per_token() * 8192
    assert per_sequence == 2 * 2 * 40 * 128 * 40 * 8192 == 6_710_886_400
    # The book writes 6.7 "GB" in the text and "GiB" in the table; its totals (32.7 = 26 + 6.7) and
    # step times (32.7e9 B / 6.56e12 B/s = 4.98 ms) are decimal: GB is right, 6.71e9 B = 6.25 GiB.
    assert round(per_sequence / 1e9, 2) == 6.71
    assert round(per_sequence / 2**30, 2) == 6.25


def test_the_book_table_from_its_rounded_figures() -> None:
    points = serving.latency_throughput(13e9, 6.7e9, BATCHES, 8, BOOK_V5E)
    assert [round(p.step * 1e3, 2) for p in points] == list(BOOK_STEP_MS)
    assert [round(p.tokens_per_second, 2) for p in points] == pytest.approx(BOOK_TOKENS_PER_S, abs=0.011)


def test_the_book_gqa_table_a_five_times_smaller_cache() -> None:
    """The book's second table: 8 KV heads for 40 query heads (1:5), parameters held at 13e9."""
    points = serving.latency_throughput(13e9, 6.7e9 / 5, BATCHES, 8, BOOK_V5E)
    assert [round(p.step * 1e3, 2) for p in points] == [4.17, 5.60, 7.23, 10.50, 17.04, 52.99]
    book = (239.94, 1429.19, 2212.48, 3047.62, 3756.62, 4529.34)
    assert [p.tokens_per_second for p in points] == pytest.approx(book, abs=0.011)


def test_the_book_table_from_the_exact_shapes_and_hardware_py() -> None:
    """Exact shapes (13.015e9 parameters, 6.711e9 B of cache) at 8.1e11 B/s: 1.3-1.5 % slower."""
    model = serving.LLAMA2_13B
    points = serving.latency_throughput(model.params, model.kv_bytes_per_token() * 8192, BATCHES, 8, "v5e")
    for point, book in zip(points, BOOK_STEP_MS, strict=True):
        assert 1.01 < point.step * 1e3 / book < 1.02


def test_llama3_70b_cache_and_the_smallest_bf16_slice() -> None:
    """The book's "Serving LLaMA 3-70B": 160 KiB of int8 cache per token; in bf16 on a v5e 4x4,
    256 GB less 140 GB of weights leaves room for 43 caches of 8k tokens (42 from the exact shapes).
    Its int8 row (8 chips, "68" GB left, 52 caches) does not add up: 128 GB less 70 GB is 58 GB, 43 caches."""
    model = serving.LLAMA3_70B
    assert model.kv_bytes_per_token("int8") == 160 * 1024 and round(model.params / 1e9, 2) == 70.55
    assert serving.cache_fits(70e9, 324e3 * 8192, 16, "v5e") == 43
    assert serving.cache_fits(model.params, model.kv_bytes_per_token() * 8192, 16, "v5e") == 42
    assert serving.cache_fits(70e9, 162e3 * 8192, 8, "v5e", "int8") == 43


def test_pop_quiz_30b_int8_on_a_v5e_4x4() -> None:
    cache = 100e3 * 8192  # 100 kB per token, 8k context: 819 MB per sequence
    small, large = (serving.decode_step_time(30e9, cache, b, 16, "v5e", "int8") for b in (4, 256))
    assert round(small * 1e3, 1) == 2.6  # the book: "2.5 ms" (2.57, rounded down)
    assert round(large * 1e3) == 21  # the book: "21ms": 16.2 ms of cache reads + 4.9 ms of FLOPs
    # the plain roofline, cache reads hidden under the FLOPs, would say 18.5 ms
    plain = max(2 * 256 * 30e9 / (16 * 1.97e14), (30e9 + 256 * cache) / (16 * 8.1e11))
    assert round(plain * 1e3, 1) == 18.5 < large * 1e3


def test_critical_batch_halves_with_int8_weights_and_quarters_with_int4() -> None:
    bf16, int8, int4 = (serving.decode_critical_batch("v5e", w) for w in ("bfloat16", "int8", "int4"))
    assert round(bf16) == 243 and int8 == bf16 / 2 and int4 == bf16 / 4
    # at the critical batch the matmuls' FLOPs take as long as their weights' reads
    params = 1e9
    at = serving.decode_step_time(params, 0.0, round(bf16), 1, "v5e")
    assert at == pytest.approx(2 * params / HARDWARE["v5e"].hbm_bandwidth, rel=2e-3)


def test_throughput_grows_with_the_batch_and_latency_with_it() -> None:
    points = serving.latency_throughput(13e9, 6.7e9, BATCHES, 8, "v5e")
    assert all(
        a.step < b.step and a.tokens_per_second < b.tokens_per_second for a, b in itertools.pairwise(points)
    )
    assert points[0].per_chip == pytest.approx(points[0].tokens_per_second / 8)


def test_gqa_and_int8_shrink_the_cache_and_more_fits() -> None:
    gqa = dataclasses.replace(serving.LLAMA2_13B, kv_heads=8)  # the book's 1:5 grouped queries
    assert serving.LLAMA2_13B.kv_bytes_per_token() == 5 * gqa.kv_bytes_per_token()
    fits = [
        serving.cache_fits(m.params, m.kv_bytes_per_token(p) * 8192, 8, "v5e", p)
        for m, p in ((serving.LLAMA2_13B, "bfloat16"), (gqa, "bfloat16"), (gqa, "int8"))
    ]
    assert fits[0] < fits[1] < fits[2]


def test_bad_precision_and_batch_are_named() -> None:
    with pytest.raises(ValueError, match="precision"):
        serving.number_bytes("fp8")
    with pytest.raises(ValueError, match="batch"):
        serving.decode_step_time(1e9, 1e6, 0, 1, "v5e")


def test_explain_decode_prints_the_roofline_from_serving(capsys):
    assert main(["explain", "--decode", "--size", "llama2-13b", "--hardware", "v5e", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line.split()[0].isdigit()}
    assert sorted(rows) == [1, 8, 16, 32, 64, 128, 240]  # the book's batches, up to the critical 240
    model = serving.LLAMA2_13B
    expected = serving.latency_throughput(model.params, model.kv_bytes_per_token() * 8192, (1, 240), 8, "v5e")
    assert float(rows[1][1]) == round(expected[0].step * 1e3, 2) and rows[1][4] == "yes"
    assert float(rows[240][2]) == round(expected[1].tokens_per_second, 2) and rows[240][4] == "no"
    assert rows[1][5].count("#") < rows[240][5].count("#") == decode.BAR  # the picture: a bar per row
    assert "15 sequences fit" in out and "prefill of 8,192 tokens: 135.3 ms" in out


def test_explain_decode_kv_heads_prices_grouped_query_serving_as_the_replaced_size(capsys):
    """docs/serving.md's ``dataclasses.replace(serving.LLAMA2_13B, kv_heads=8)``, from the command line."""
    flags = ["explain", "--decode", "--size", "llama2-13b", "--hardware", "v5e", "--devices", "8"]
    assert main([*flags, "--kv-heads", "8"]) == 0
    out = capsys.readouterr().out
    grouped = dataclasses.replace(serving.LLAMA2_13B, kv_heads=8)
    chip, llama = hardware_named("v5e"), serving.LLAMA2_13B
    fits = serving.cache_fits(grouped.params, grouped.kv_bytes_per_token() * 8192, 8, chip, "bfloat16")
    assert out.splitlines()[0] == (
        f"llama2-13b with 8 KV heads ({grouped.params / 1e9:.2f}e9 parameters) on 8 TPU v5e, bfloat16"
    )
    assert f"{grouped.kv_bytes_per_token():,.0f} B per token" in out and f"{fits} sequences fit" in out
    assert fits > serving.cache_fits(llama.params, llama.kv_bytes_per_token() * 8192, 8, chip, "bfloat16")
    assert main([*flags, "--kv-heads", "40"]) == 0  # its own count: the size as it is
    assert capsys.readouterr().out.startswith("llama2-13b (13.02e9 parameters)")


def test_explain_decode_in_int8_halves_the_batch_and_the_cache(capsys):
    flags = ["explain", "--decode", "--hardware", "v5e", "--quantize", "int8", "--context", "4096"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "409,600 B per token" in out and out.strip().splitlines()[-1].split()[0] == "120"


def test_explain_decode_parallel_compiles_a_miniatures_decode_step_and_reads_what_it_sends(capsys):
    # llama3-70b's 64 heads and 8 KV heads at head_dim 8 (width 512), 2 blocks, batch 8 (--devices).
    flags = ["explain", "--decode", "--size", "llama3-70b", "--hardware", "v5e", "--devices", "8"]
    sent, (heads, head_dim, width) = {}, (64, 8, 512)
    # XLA's bytes accessed over params + B·KV, measured (docs/serving.md): what grows with the sequences
    # a device decodes (activations between fusions, the cache's copies) is more where it holds more
    xla_over_predicted = {"tp": 1.70, "dp": 1.25, "2d": 1.39, "cp": 1.35, "dp+cp": 1.30}
    heads_split = {"tp": 8, "2d": 4}  # the model axis
    for style in ("tp", "dp", "2d", "cp", "dp+cp"):
        assert main([*flags, "--parallel", style]) == 0
        census = capsys.readouterr().out.split("one decode step, batch 8, ")[1].splitlines()
        sent[style] = census[1].strip()
        numbers = re.findall(r"\d[\d,]*", census[-1])  # accessed; params + cached = predicted
        accessed, params, cached, predicted = (int(n.replace(",", "")) for n in numbers[:4])
        # K, V; blocks, B, T, KV heads, D, f32: every style keeps an eighth of it on each device
        # (tp its KV head, dp its sequence, 2d a half of the sequences' 2 heads, cp its 8 positions)
        assert cached == 2 * 2 * 8 * decode.MINIATURE["context"] * 8 * 8 * 4 // 8
        # the floor: params + B·KV, and Attention.project's stack of the q, k, v weights copied every step
        # (read and written: 2 x), 64 + 2 x 8 heads of head_dim 8 per block, the heads split over model
        stack = 2 * 4 * 2 * width * (heads + 2 * 8) * head_dim // heads_split.get(style, 1)
        assert predicted == params + cached and predicted + stack <= accessed
        ratio, documented = accessed / predicted, xla_over_predicted[style]
        assert 0.85 * documented <= ratio <= 1.15 * documented, f"{style}: XLA {ratio:.2f}x, not {documented}"
    # Per block, an all-reduce of the B x width activations after attention and one after the MLP;
    # 2d reduces each "data" half's 4 sequences over model=4: half the bytes.
    assert sent["tp"] == f"all-reduce: 4 x, {4 * 8 * width * 4:,} B per device over model"
    assert sent["2d"] == f"all-reduce: 4 x, {4 * 4 * width * 4:,} B per device over model"
    assert sent["dp"] == "no collectives"
    # cp, per block: the max of each query head's lse [B, H], then the weighted outputs [B, H, D] and
    # their sums [B, H] in one all-reduce; and the new position's row of the split position table.
    for style, batch in (("cp", 8), ("dp+cp", 4)):
        merged = 2 * (batch * heads * 4 + batch * heads * (head_dim + 1) * 4) + width * 4
        assert sent[style] == f"all-reduce: 5 x, {merged:,} B per device over context"


def test_under_dp_xla_reads_the_weights_and_the_cache_and_the_stacked_qkv_copy_and_little_else():
    # One sequence per device, every weight whole: XLA's bytes accessed are params + B·KV, plus
    # Attention.project's jnp.stack of the q, k, v weights (a copy per step: read and written), and
    # within 10% of the prediction the rest (activations, the cache's copies): docs/serving.md.
    size = serving.SIZES["llama3-8b"]
    head_dim, depth, context = decode.MINIATURE.values()
    model = jax.eval_shape(
        lambda: GPT(
            context=context,
            width=size.heads * head_dim,
            depth=depth,
            heads=size.heads,
            kv_heads=size.kv_heads,
            key=jax.random.key(0),
        )
    )
    caches = model.init_cache(8)
    compiled = decoder("dp").lower(model, jnp.zeros((8, 1), jnp.int32), caches, jnp.asarray(1)).compile()
    placed_as = compiled.input_shardings[0]
    predicted = per_device(model, placed_as[0]) + per_device(caches, placed_as[2])
    weights = [(b.attention.query, b.attention.key, b.attention.value) for b in model.blocks]
    qkv = sum(w.size * w.dtype.itemsize for block in weights for w in block)  # whole on each device
    accessed = compiled.cost_analysis()["bytes accessed"]
    assert predicted < accessed - 2 * qkv < 1.1 * predicted


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--decode"], "argument --hardware: --decode prices serving on a chip"),
        (
            ["--decode", "--hardware", "v5e", "--parallel", "fsdp"],
            "argument --parallel: --decode compiles a decode step under tp, dp, 2d, cp, dp+cp, not fsdp",
        ),
        (
            ["--decode", "--hardware", "v5e", "--size", "llama3-70b", "--parallel", "tp", "--devices", "16"],
            "argument --parallel: tp splits llama3-70b's 8 KV heads over model=16 devices: uneven",
        ),
        (
            ["--decode", "--hardware", "v5e", "--parallel", "cp", "--devices", "48"],
            "argument --devices: cp splits the miniature's 64 cached positions over context=48 devices",
        ),
        (["--decode", "--hardware", "v5e", "--width", "64"], "argument --width: --decode prices"),
        (
            ["--decode", "--hardware", "v5e", "--size", "llama2-13b", "--kv-heads", "7"],
            "argument --kv-heads: 7 must divide llama2-13b's 40 heads",
        ),
        (
            ["--decode", "--hardware", "v5e", "--size", "llama2-13b", "--kv-heads", "4", "--parallel", "tp"],
            "argument --parallel: tp splits llama2-13b's 4 KV heads over model=8 devices: uneven",
        ),
        (
            ["--size", "llama2-13b", "--hardware", "v5e"],
            "argument --size: only --decode or --compare takes it",
        ),
        (["--decode", "--hardware", "v5e", "--quantize", "fp8"], "argument --quantize: invalid choice"),
    ],
)
def test_explain_decode_refuses_bad_flags_in_one_line(flags, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["explain", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err, err
