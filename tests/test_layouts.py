"""Layouts ranked without compiling (minishard.layouts) against the scaling book's LLaMA-3 walk-through.

Oracles (jax-ml/scaling-book at 345a75a, ``applied-training.md``, "Training LLaMA 3 on TPUs", and
the rules it takes from ``training.md``): LLaMA-3 70B, 4M tokens a batch, 8,960 TPU v5p. Every
figure is recomputed from minishard's functions, serving.py's shapes and hardware.py's chips;
where minishard's differs from the book's, both are asserted and the comment says why.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

from minishard import experts, layouts
from minishard.costs import critical_batch, mixed_critical_batch, sent_bytes
from minishard.hardware import HARDWARE
from minishard.layouts import CHECKPOINTS, Kept, Layout, _among, price, rank
from minishard.memory import bytes_per_parameter
from minishard.models.gpt import GPT
from minishard.models.transformer import moe_mlp
from minishard.pipeline import bubble_fraction, in_flight
from minishard.precision import MIXED, PRECISIONS
from minishard.remat import POLICIES, step_flops
from minishard.run.next_token import next_token_loss
from minishard.serving import LLAMA3_70B, MINISHARD_GPT, SIZES, decode_critical_batch

POD = 8960  # 16 x 20 x 28 TPU v5p
BATCH = 4 * 2**20  # "4M tokens": the book's 4 * 1024 * 1024 / 8960 = 468
V5P = HARDWARE["v5p"]
BOOK = 0  # the book's step counts 6P FLOPs a token and leaves attention out: no sequence length


def test_parameters_and_flops_of_llama3_70b() -> None:
    # The book adds its rounded terms, 56.3e9 + 2.1e9 + 12e9 = 70.4e9; unrounded they are
    # 56.37e9 + 2.10e9 + 12.08e9 = 70.55e9, which serving's count gives.
    assert round(LLAMA3_70B.params / 1e9, 2) == 70.55
    # "6 * 70e9 = 4.2e11 FLOPs / token"; "4.2e11 * 15e12 = 6.3e24 FLOPs" (from 70e9 parameters)
    assert round(layouts.train_flops(LLAMA3_70B, 1) / 1e11, 1) == 4.2
    assert round(layouts.train_flops(LLAMA3_70B, 15e12) / 1e24, 1) == 6.3
    # "about 1ms on a single TPU v5p chip": 4.2e11 / 4.59e14
    assert round(layouts.train_seconds(LLAMA3_70B, 1, 1, "v5p", mfu=1.0) * 1e3, 1) == 0.9


def test_fifteen_trillion_tokens_take_about_44_days_on_a_pod_at_40_percent_mfu() -> None:
    seconds = layouts.train_seconds(LLAMA3_70B, 15e12, POD, "v5p", mfu=0.4)
    # The book: "6.3e24 / (8960 * 4.59e14 * 0.4) = 3.8e6 seconds ... about 44 days" from 70e9
    # parameters; from 70.55e9 it is 3.86e6 s, 44.7 days. Scaled back to 70e9: 44.3 days.
    assert round(seconds / 1e6, 1) == 3.9 and math.floor(seconds / 86400) == 44
    assert math.floor(seconds * 70e9 / LLAMA3_70B.params / 86400) == 44


def test_468_tokens_per_chip_are_below_the_850_that_pure_fsdp_needs() -> None:
    pure = price(LLAMA3_70B, Layout(fsdp=POD), BATCH, "v5p", context=BOOK)
    assert round(pure.tokens) == 468  # "4 * 1024 * 1024 / 8960 = 468 tokens"
    assert critical_batch(V5P, n_axes=3) == 850  # "2550 / n_axes ... 3 axes ... a lower bound of 850"
    assert pure.layout.axes(V5P) == {"fsdp": 3}
    assert round(pure.flips_at) == 850  # priced collective by collective, the same rule
    assert pure.bound == pytest.approx(850 / pure.tokens)  # "the answer is no ... communication-bound"
    assert pure.bound > 1.8


def test_fsdp_with_tensor_parallelism_is_bound_below_453_and_x_opt_is_1618() -> None:
    # "2 * 2550^2 / F = 453", F = 28,672: 453.58, which the book truncates
    assert round(mixed_critical_batch("v5p", LLAMA3_70B.hidden), 2) == 453.58
    assert mixed_critical_batch("v5p", LLAMA3_70B.hidden) < BATCH / POD  # "we're slightly above this"
    # "X_opt = sqrt(2 * 4.19e6 * 8960 / 28672) = 1618"; from 4 * 2**20 tokens exactly, 1619
    assert round(layouts.optimal_fsdp(4.19e6, POD, LLAMA3_70B.hidden)) == 1618
    assert round(layouts.optimal_fsdp(BATCH, POD, LLAMA3_70B.hidden)) == 1619


def test_parameters_optimizer_state_and_checkpoints_in_bytes() -> None:
    terms = bytes_per_parameter(MIXED, "adamw")
    # "2 * 70GB ~140GB" and "8 * 70GB ~560GB", from 70e9 parameters; 141 and 564 GB from 70.55e9.
    # (The memory chapter adds what the book leaves out: bf16 gradients and a float32 master copy.)
    assert round(terms["parameters"] * LLAMA3_70B.params / 1e9) == 141
    assert round(terms["moments"] * LLAMA3_70B.params / 1e9) == 564
    # "2 * 8192 * 4e6 * 3 * 80 ~20.9TB": the question says 4 checkpoints per layer, and 20.9 TB
    # is 4 of them (3 would be 15.7 TB); the book truncates 20.97. From 4 * 2**20 tokens: 22.0 TB.
    assert layouts.checkpoint_bytes(LLAMA3_70B, 4e6, per_layer=4) == 2 * 8192 * 4e6 * 4 * 80
    assert math.floor(layouts.checkpoint_bytes(LLAMA3_70B, 4e6) / 1e11) / 10 == 20.9
    assert round(layouts.checkpoint_bytes(LLAMA3_70B, BATCH) / 1e12, 1) == 22.0
    total = (terms["parameters"] + terms["moments"]) * LLAMA3_70B.params + layouts.checkpoint_bytes(
        LLAMA3_70B, 4e6
    )
    # "about 21.6TB ... 21.6e12 / 96e9 = 225 TPUs ... about 2.4GB per chip" (on the pod)
    assert math.floor(total / 1e11) / 10 == 21.6
    assert math.floor(total / V5P.hbm_bytes) == 225
    assert round(total / POD / 1e9, 1) == 2.4


def test_the_ranking_leads_to_the_books_fsdp_and_tensor_split() -> None:
    # Ranked as the step runs, sequences of 4,096 (attention's FLOPs counted, cp among the dimensions)
    ranking = rank(LLAMA3_70B, BATCH, POD, "v5p")
    best, pure = ranking.costs[0], price(LLAMA3_70B, Layout(fsdp=POD), BATCH, "v5p")
    # The book rounds X_opt = 1,618 to "2048-way FSDP and 4-way model parallelism" (8,192 chips);
    # of the pod's own factorisations tp 4 takes fsdp 2,240, and it ranks first, FSDP on 2 axes.
    assert best.layout == ranking.rule == Layout(fsdp=2240, tp=4)
    assert best.layout.axes(V5P) == {"fsdp": 2, "tp": 1}
    assert best.fits and best.step_s < pure.step_s and best.bound < pure.bound
    # On 8,192 chips the book's own 2048 x 4 ranks first too; priced as the book prices it (6P a
    # token) it sits at the flip: the book's rule (MLP only) says compute-bound at 512 > 453
    # tokens; with attention's tensor collectives (the book leaves them out) it flips at 513.
    on_8192 = rank(LLAMA3_70B, BATCH, 8192, "v5p").costs[0]
    assert on_8192.layout == Layout(fsdp=2048, tp=4)
    assert round(price(LLAMA3_70B, on_8192.layout, BATCH, "v5p", context=BOOK).bound, 2) == 1.0
    # attention's FLOPs (12 L T N H a token) are more for the collectives to hide behind
    assert on_8192.bound < 1


def test_pure_data_parallelism_does_not_fit_and_every_term_is_per_device() -> None:
    replicas = price(LLAMA3_70B, Layout(dp=POD), BATCH, "v5p", context=BOOK)
    assert not replicas.fits  # every replica holds 16 bytes per parameter: 1.13 TB
    per_parameter = sum(bytes_per_parameter(MIXED, "adamw").values())
    assert replicas.memory.total > per_parameter * LLAMA3_70B.params > V5P.hbm_bytes
    split = price(LLAMA3_70B, Layout(fsdp=POD // 4, tp=4), BATCH, "v5p", context=BOOK)
    assert split.memory.terms["moments"] == 8 * LLAMA3_70B.params / POD


def test_fsdp_bytes_stay_and_tensor_bytes_grow_with_the_batch() -> None:
    layout = Layout(fsdp=2240, tp=4)
    small, large = (price(LLAMA3_70B, layout, tokens, "v5p", context=BOOK) for tokens in (BATCH, 2 * BATCH))
    assert large.forward.weights == small.forward.weights
    assert large.forward.activations == pytest.approx(2 * small.forward.activations)
    assert large.compute_s == pytest.approx(2 * small.compute_s)


@pytest.mark.parametrize("layout", [Layout(fsdp=POD), Layout(fsdp=2240, tp=4), Layout(dp=70, fsdp=32, tp=4)])
def test_flips_at_is_where_the_bound_crosses_one(layout: Layout) -> None:
    at = price(LLAMA3_70B, layout, BATCH, "v5p", context=BOOK).flips_at
    below, above = (price(LLAMA3_70B, layout, round(at * f * POD), "v5p", context=BOOK) for f in (0.99, 1.01))
    assert below.bound > 1 >= above.bound


def test_layouts_are_every_split_the_model_takes() -> None:
    found = layouts.layouts(LLAMA3_70B, POD)
    assert all(layout.devices == POD for layout in found) and len(set(found)) == len(found)
    assert {layout["tp"] for layout in found} == {1, 2, 4, 8, 16, 32, 64}  # tp divides 64 heads and 28,672
    six_heads = dataclasses.replace(SIZES["llama3-8b"], heads=6)
    assert {layout["tp"] for layout in layouts.layouts(six_heads, 8)} == {1, 2}


def test_a_torus_of_fewer_axes_than_dimensions_shares_them() -> None:
    three = Layout(dp=2, fsdp=2, tp=2)
    assert three.axes(HARDWARE["v5e"]) == pytest.approx({"dp": 2 / 3, "fsdp": 2 / 3, "tp": 2 / 3})
    assert three.axes(V5P) == {"dp": 1, "fsdp": 1, "tp": 1}
    assert Layout(fsdp=8).axes(HARDWARE["v5e"]) == {"fsdp": 2}


def test_the_table_marks_the_fastest_and_the_books_rule_and_counts_the_rest() -> None:
    table = rank(LLAMA3_70B, BATCH, POD, "v5p").table(top=2)
    rows = table.splitlines()
    assert rows[1].startswith("* fsdp 2240 (2 axes) x tp 4") and "<- the book's X_opt" in rows[1]
    # 1,024 sequences over 2,240 FSDP shards: each holds part of one, said (its K/V priced: ``sends``)
    assert rows[1].endswith(f"[a sequence over {2240 / 1024:.3g} shards]")
    assert any(row.startswith("  fsdp 8960 (3 axes)") for row in rows)  # pure FSDP: the best of its kind
    assert "do not fit" in rows[-1]


def test_fewer_tokens_than_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="rank: tokens"):
        rank(LLAMA3_70B, 100, POD, "v5p")


def test_a_step_s_memory_in_each_precision_train_offers() -> None:
    model, layout, tokens = SIZES["llama3-8b"], Layout(fsdp=8), 8 * 8192  # a sequence a device
    mixed = price(model, layout, tokens, "h100", context=8192).memory.terms
    for precision in PRECISIONS.values():  # fp32; bf16 and fp16 computing on a float32 master
        held = price(model, layout, tokens, "h100", Kept(precision=precision), context=8192)
        per_parameter = bytes_per_parameter(precision)
        for name in ("parameters", "gradients"):
            assert held.memory.terms[name] == per_parameter[name] * model.params / 8
        assert held.memory.terms.get("master", 0) == per_parameter["master"] * model.params / 8
        # activations in the dtype the step computes in: Korthikanti's 16 bits, float32 twice them
        wide = {"float32": 2, "bfloat16": 1, "float16": 1}[precision.params]
        for name in ("activations", "recomputed layer"):
            assert held.memory.terms[name] == wide * mixed[name]


def test_a_step_s_memory_under_each_remat_policy_train_offers() -> None:
    model, layout, tokens = SIZES["llama3-8b"], Layout(fsdp=8), 8 * 8192
    held = {
        remat: price(model, layout, tokens, "h100", Kept(remat=remat), context=8192).memory.terms
        for remat in POLICIES
    }
    streams = 2 * model.width * model.layers * 8192  # one bf16 stream a layer of a device's tokens
    assert held["full"]["activations"] == CHECKPOINTS * streams  # the book's 4 a layer
    # none: every layer's activations (Korthikanti's 34 sbh, fused), and nothing recomputed
    assert held["none"]["activations"] == 34 / 2 * streams and "recomputed layer" not in held["none"]
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim / model.width  # in streams: 1.5
    assert held["names"]["activations"] == (2 + qkv) * streams  # its input, q, k, v, attention's out
    assert held["full"]["activations"] < held["dots"]["activations"] < held["none"]["activations"]
    with pytest.raises(ValueError, match="rank: remat must be one of 'none', 'full'"):
        rank(model, tokens, 8, "h100", context=8192, kept=Kept(remat="selective"))


@pytest.mark.parametrize("remat", list(POLICIES))
def test_the_recomputed_flops_are_those_the_gpts_step_runs_again(remat: str) -> None:
    """From shapes, what minishard's GPT under ``--remat`` runs beyond its model FLOPs, counted from
    its step's jaxprs (``remat.step_flops``, nothing compiled), grouped K/V heads too."""
    window = jax.ShapeDtypeStruct((2, 64), np.int32)
    gpt = GPT(key=jax.random.key(0), remat=remat, kv_heads=2)  # MINISHARD_GPT's shape, 2 K/V heads
    flops = step_flops(next_token_loss, gpt, {"inputs": window, "targets": window})
    size = dataclasses.replace(MINISHARD_GPT, kv_heads=2)
    assert flops.hardware - flops.model == layouts.recomputed_flops(size, 2 * 64, 64, remat)


def test_a_mixture_recomputes_its_experts_at_their_capacity_and_its_one_hot_dispatch() -> None:
    """minishard's mixture (4 experts, 2 a token, capacity factor 4) runs every expert at its
    capacity, empty slots too: what it runs again is ``recomputed_flops`` at that capacity factor
    (top_k slots alone: 3.2 times too few), and its one-hot dispatch, 2·S·(E·C)·M a sequence and
    layer, which a dropless kernel does not run; beside them the masks' einsums (3.5%)."""
    window = jax.ShapeDtypeStruct((2, 64), np.int32)
    batch = {"inputs": window, "targets": window}

    def hardware_flops(remat: str) -> float:
        gpt = GPT(key=jax.random.key(0), remat=remat, mlp=moe_mlp(4, k=2, capacity_factor=4.0))
        return step_flops(next_token_loss, gpt, batch).hardware

    size = dataclasses.replace(MINISHARD_GPT, experts=4, top_k=2)
    slots = 4 * experts.capacity(64, 4, 2, 4.0)  # E·C of a sequence
    dispatch = size.layers * 2 * (2 * 64 * slots * size.width)  # two sequences, each a group
    plain = hardware_flops("none")
    for remat in ("names", "full"):
        again = hardware_flops(remat) - plain
        formula = layouts.recomputed_flops(size, 2 * 64, 64, remat, capacity_factor=4.0)
        assert formula + dispatch <= again <= formula + 1.04 * dispatch, remat


def test_the_step_counts_what_its_remat_policy_recomputes_and_mfu_only_the_models() -> None:
    model, layout, tokens = SIZES["llama3-8b"], Layout(fsdp=8), 8 * 8192
    costs = {
        remat: price(model, layout, tokens, "h100", Kept(remat=remat), context=8192) for remat in POLICIES
    }
    again = layouts.recomputed_flops(model, tokens / 8, 8192)  # full: all but each MLP's last matmul
    assert costs["full"].recomputed_s * HARDWARE["h100"].flops == pytest.approx(again)
    assert costs["none"].recomputed_s == costs["dots"].recomputed_s == 0
    full, none = costs["full"], costs["none"]  # compute-bound, both
    assert full.step_s - none.step_s == pytest.approx(full.recomputed_s)
    assert full.mfu * full.step_s == pytest.approx(3 * full.compute_s)  # the model's FLOPs alone
    assert full.hfu / full.mfu == pytest.approx(1 + again / layouts.train_flops(model, tokens / 8, 8192))
    assert 1.2 < full.hfu / full.mfu < 4 / 3  # Korthikanti's whole pass again would be 4/3


def test_fewer_checkpoints_hold_less_and_change_nothing_else() -> None:
    four, one = (
        price(LLAMA3_70B, Layout(fsdp=2240, tp=4), BATCH, "v5p", Kept(checkpoints=n), context=BOOK)
        for n in (4, 1)
    )
    assert four.memory.terms["activations"] == 4 * one.memory.terms["activations"]
    assert four.step_s == one.step_s


# -- pipeline parallelism: the chapter's bubble, a stage's share of memory --------------------------------
SIXTEEN_M = 16 * 2**20  # LLaMA-3's later batches: 4,096 sequences of 4,096


def test_a_pipeline_idles_in_the_chapters_bubble_and_its_microbatches_are_whole_sequences() -> None:
    layout = Layout(fsdp=56, tp=8, pp=20)  # 8,960 chips; each pipeline gets 1,024 / 56 = 18.3 sequences
    cost = price(LLAMA3_70B, layout, BATCH, "v5p")
    assert cost.microbatches == 18 == BATCH // 56 // layouts.CONTEXT
    assert cost.bubble == bubble_fraction(20, 18)  # (p-1)/(m+p-1), pipeline.py's
    assert cost.step_s == pytest.approx(cost.busy_s / (1 - cost.bubble))
    assert cost.idle_s == pytest.approx(cost.step_s * cost.bubble)
    # Longer sequences: fewer of them a pipeline, fewer microbatches, a larger bubble
    longer = price(LLAMA3_70B, layout, BATCH, "v5p", context=8192)
    assert longer.microbatches == 9 and longer.bubble > cost.bubble
    # Without pp there is no bubble, and one microbatch: the whole batch in one pass
    flat = price(LLAMA3_70B, Layout(fsdp=2240, tp=4), BATCH, "v5p")
    assert (flat.microbatches, flat.bubble, flat.step_s) == (1, 0.0, flat.busy_s)


def test_a_microbatch_keeps_enough_tokens_for_its_matmuls_to_outrun_hbm() -> None:
    # Sequences of 64 tokens: 164 of them (C / W of HBM, decoding's critical batch) make a microbatch
    critical = decode_critical_batch("v5p")
    assert round(critical) == 164
    layout = Layout(fsdp=64, pp=4)
    assert layouts.microbatches(layout, BATCH, "v5p", context=64) == int(BATCH / 64 // critical)
    assert layouts.microbatches(layout, BATCH, "v5p", context=4096) == BATCH // 64 // 4096


def test_a_stage_holds_its_share_of_the_weights_and_its_microbatches_in_flight() -> None:
    piped, flat = (
        price(LLAMA3_70B, layout, BATCH, "v5p")
        for layout in (Layout(fsdp=4, tp=8, pp=4), Layout(fsdp=4, tp=8))
    )
    assert piped.memory.terms["moments"] == flat.memory.terms["moments"] / 4  # a quarter of the layers
    # FSDP under pp keeps the stage's gathered layers through its microbatches (torchtitan's default)
    assert piped.memory.terms["gathered"] == 2 * LLAMA3_70B.params / 4 / 8
    assert flat.memory.terms["gathered"] == 2 * LLAMA3_70B.params / LLAMA3_70B.layers / 8
    # ... so its backward pass gathers nothing again: it scatters the gradients alone (as many bytes)
    assert piped.backward.weights == pytest.approx(piped.forward.weights)
    assert flat.backward.weights == pytest.approx(2 * flat.forward.weights)  # gathers again, and scatters
    # 1F1B: the first stage holds p of its m microbatches' checkpoints, of a quarter of the layers
    m = piped.microbatches
    assert m == 256 and piped.memory.terms["activations"] == pytest.approx(
        flat.memory.terms["activations"] * 4 / m / 4
    )


def test_pipeline_stages_take_no_torus_axis_and_divide_the_layers() -> None:
    assert Layout(fsdp=560, tp=4, pp=4).axes(V5P) == Layout(fsdp=2240, tp=4).axes(V5P)
    found = layouts.layouts(LLAMA3_70B, POD)
    assert {layout["pp"] for layout in found} == {1, 2, 4, 5, 8, 10, 16, 20, 40, 80}  # 80 layers
    assert {layout["pp"] for layout in layouts.layouts(SIZES["llama3-405b"], 1024)} == {1, 2}  # 126 layers


def test_the_book_s_choice_still_ranks_first_and_the_best_pipeline_loses_to_its_bubble() -> None:
    ranking = rank(LLAMA3_70B, BATCH, POD, "v5p")
    best = ranking.costs[0]
    piped = next(cost for cost in ranking.costs if cost.layout["pp"] > 1)
    assert best.layout == ranking.rule == Layout(fsdp=2240, tp=4)  # X_opt's FSDP x TP is no pipeline
    # 1,024 sequences over 8,960 chips: a pipeline is fed few microbatches, and idles more than
    # FSDP + TP waits on its collectives (with attention's FLOPs, neither waits on any)
    assert piped.fits and piped.step_s > best.step_s and piped.waiting_s == best.waiting_s == 0
    assert piped.idle_s > 0 and piped.busy_s <= best.busy_s


def test_pipelines_enter_the_ranking_where_the_whole_batch_does_not_fit() -> None:
    # LLaMA-3 405B, 16M tokens on 1,024 v5p: every layout without pp holds the whole batch's
    # checkpoints and none fits; a pipeline's first stage holds p microbatches' and fits.
    ranking = rank(SIZES["llama3-405b"], SIXTEEN_M, 1024, "v5p")
    best = ranking.costs[0]
    assert best.fits and best.layout["pp"] == 2 and best.bubble < 0.01
    flat = [cost for cost in ranking.costs if cost.layout["pp"] == 1]
    assert not any(cost.fits for cost in flat)
    fastest = min(flat, key=lambda cost: cost.step_s)
    assert fastest.step_s < best.step_s and fastest.memory.terms["activations"] > V5P.hbm_bytes


# -- issue 63: the sequence in the step, context parallelism, the network's two levels ---------------
H100_RUN = (SIZES["llama3-405b"], SIXTEEN_M, 16384, "h100")  # Meta's 405B: 16M tokens on 16,384 H100


def test_attention_adds_palms_12_l_t_n_h_a_token() -> None:
    llama = SIZES["llama3-405b"]
    per_token = 12 * llama.layers * 8192 * llama.heads * llama.head_dim
    assert layouts.train_flops(llama, 1, 8192) - layouts.train_flops(llama, 1) == per_token
    # the step's forward pass is a third of them, per device
    cost = price(llama, Layout(dp=2, fsdp=128, tp=16, pp=2, cp=2), SIXTEEN_M, "h100", context=8192)
    assert cost.compute_s * 3 * HARDWARE["h100"].flops == pytest.approx(
        layouts.train_flops(llama, SIXTEEN_M / 16384, 8192)
    )


def test_a_longer_sequence_steps_slower_for_405b_on_16384_h100() -> None:
    model, tokens, devices, chip = H100_RUN
    short, long = (rank(model, tokens, devices, chip, context=t).costs[0] for t in (4096, 8192))
    assert long.step_s > short.step_s  # 3.35 s against 3.17 s: attention's FLOPs double
    layout = Layout(fsdp=1024, tp=16)
    at = {t: price(model, layout, tokens, chip, context=t) for t in (4096, 8192)}
    attention = 12 * model.layers * 4096 * model.heads * model.head_dim  # the extra FLOPs a token
    assert (at[8192].compute_s - at[4096].compute_s) * 3 * HARDWARE["h100"].flops == pytest.approx(
        attention * tokens / devices
    )


def test_without_a_fused_kernel_the_recomputed_layer_keeps_every_heads_scores() -> None:
    model, tokens, _, chip = H100_RUN
    layout = Layout(fsdp=1024, tp=16)
    held = {
        (t, fused): price(model, layout, tokens, chip, context=t, fused=fused).memory.terms
        for t in (4096, 8192)
        for fused in (True, False)
    }
    held = {key: terms["recomputed layer"] for key, terms in held.items()}
    assert held[4096, True] == held[8192, True]  # FlashAttention: 34 sbh, whatever the sequence
    shard = tokens / 1024  # one FSDP shard's tokens, split over tp 16
    scores = 5 * model.heads * 4096 * shard / 16  # Korthikanti's 5as/h, in bytes, doubled with T
    assert held[8192, False] - held[4096, False] == pytest.approx(scores)
    assert held[4096, False] - held[4096, True] == pytest.approx(scores)


def test_context_parallelism_gathers_each_layers_keys_and_values_and_all_reduces_gradients() -> None:
    llama, tokens = SIZES["llama3-8b"], 2**20
    sent = layouts.bytes_sent(llama, Layout(fsdp=4, cp=2), tokens, context=8192)
    kv = 2 * 2 * llama.kv_heads * llama.head_dim  # a token's K and V, bf16
    gathered = kv * tokens / 4 * llama.layers  # every token of an FSDP shard, each layer
    gradients = 2 * llama.params / 4  # bf16, an FSDP shard's: cp's 2 devices hold the same
    # all-gather, reduce-scatter: (p-1)/p of it; the all-reduce 2 (p-1)/p of the gradients
    assert sent["cp"] == pytest.approx(2 * gathered / 2 + 2 * gradients / 2)
    assert all(layout["cp"] == 1 for layout in layouts.layouts(llama, 8))  # no sequence, no cp
    assert {layout["cp"] for layout in layouts.layouts(llama, 8, context=8192)} == {1, 2, 4, 8}


def test_a_long_sequence_brings_context_parallelism_in() -> None:
    model, tokens, devices, chip = H100_RUN
    costs = rank(model, tokens, devices, chip, context=131072).costs  # 128 sequences
    # the fastest splits each sequence: over cp, or over data shards that share one (which gather
    # its K/V as cp does, and all-reduce the gradients cp's devices all-reduce too); cp as fast
    assert costs[0].layout["cp"] > 1 or costs[0].shard_sequences < 1
    assert costs[0].step_s == min(cost.step_s for cost in costs if cost.layout["cp"] > 1)


def test_dimensions_sit_innermost_first_tp_cp_ep_pp_fsdp_dp() -> None:
    layout = Layout(dp=2, fsdp=4, tp=8, pp=16, cp=2)
    assert layouts.PLACEMENT == ("tp", "cp", "ep", "pp", "fsdp", "dp")
    assert [layout.inner(name) for name in layouts.PLACEMENT] == [1, 8, 16, 16, 256, 1024]  # no ep: 1
    assert Layout(tp=8, cp=2, ep=4, pp=2).inner("pp") == 8 * 2 * 4  # ep inside pp


def test_a_data_split_beyond_the_sequences_gathers_their_keys_and_values_and_says_so() -> None:
    # issue 59: 4M tokens of 4,096 (1,024 sequences) over 1,048,576 v5p: dp 16384 holds a 16th of one
    llama, tokens = LLAMA3_70B, BATCH
    split = price(llama, Layout(dp=16384, tp=64), tokens, "v5p")
    whole = price(llama, Layout(dp=1024, tp=64), tokens // 1024 * 1024, "v5p")
    shared = [send for send in layouts.sends(llama, split.layout, tokens, context=4096) if send.devices]
    assert {(send.dimension, send.devices) for send in shared} == {("dp", 16)}
    assert not any(send.devices for send in layouts.sends(llama, whole.layout, tokens, context=4096))
    assert split.shard_sequences == 1 / 16
    ranking = rank(llama, tokens, 1000003, "v5p")  # a prime count: fsdp 1000003, 4 tokens a device
    row = ranking.table().splitlines()[1]
    assert row.startswith("* fsdp 1000003") and row.endswith(f"[a sequence over {1000003 / 1024:.3g} shards]")


def test_an_uneven_share_of_the_sequences_is_said() -> None:
    # issue 59: 64 sequences over 7 devices
    best = rank(SIZES["llama3-8b"], 64 * 4096, 7, "h100").costs[0]
    assert best.layout == Layout(fsdp=7)
    assert best.shard_sequences == 64 / 7
    row = rank(SIZES["llama3-8b"], 64 * 4096, 7, "h100").table().splitlines()[1]
    assert row.startswith("* fsdp 7") and row.endswith(f"[uneven: {64 / 7:.4g} sequences a shard]")


def test_a_pipeline_sends_a_microbatch_every_tick_and_hands_its_output_to_every_stage() -> None:
    layout, tokens = Layout(fsdp=4, pp=4), 2**20
    hop = 2 * tokens / 4 * LLAMA3_70B.width  # a shard's residual stream, bf16
    for m in (1, 8, 64):
        ticks = (m + 4 - 1) / m  # the bubble's ticks send too
        permute, reduce = ticks * hop, 2 * 3 / 4 * hop  # each pass: a permute, an all-reduce over 4
        sent = layouts.bytes_sent(LLAMA3_70B, layout, tokens, microbatches=m)["pp"]
        assert sent == pytest.approx(2 * (permute + reduce))


def test_a_pipelines_loop_sends_its_stages_collectives_every_tick_priced_once_in_seconds() -> None:
    layout, tokens, chip = Layout(tp=4, pp=4, cp=2), 2**20, HARDWARE["v5p"]
    for m in (1, 8, 64):
        ticks = (m + 4 - 1) / m  # the bubble's ticks run the stage's tp and cp collectives too
        sent = layouts.bytes_sent(LLAMA3_70B, layout, tokens, context=4096, microbatches=m)
        for dimension in ("tp", "cp"):
            found = layouts.sends(LLAMA3_70B, layout, tokens, context=4096, microbatches=m)
            once = [(s.times * sent_bytes(s.kind, s.result_bytes, _among(s, layout)), s) for s in found]
            loop = sum(n for n, s in once if s.dimension == dimension and not s.of_weights)
            weights = sum(n for n, s in once if s.dimension == dimension and s.of_weights)
            assert sent[dimension] == pytest.approx(ticks * loop + weights)
        # in seconds the bubble is LayoutCost.step_s's: a pass's collectives do not grow with it
        seconds = layouts.pass_collectives(LLAMA3_70B, layout, tokens, chip, context=4096, microbatches=m)
        assert seconds == layouts.pass_collectives(LLAMA3_70B, layout, tokens, chip, context=4096)


def test_an_interleaved_pipeline_idles_r_times_less_for_r_times_the_hops_between_stages() -> None:
    # Narayanan et al. 2021, §2.2.2: r chunks a stage shrink the bubble to (p-1)/(r·m + p-1) of
    # the step and multiply the sends between stages by r; the matmuls and the other sends stay
    layout = Layout(fsdp=4, tp=8, pp=4)  # 20 of 70B's 80 layers a stage: r of 2, 4, 5, 10, 20
    plain = price(LLAMA3_70B, layout, BATCH, "v5p")
    m = plain.microbatches
    for r in (2, 4):
        cost = price(LLAMA3_70B, layout, BATCH, "v5p", repeats=r)
        assert cost.repeats == r and cost.bubble == bubble_fraction(4, m, r) == 3 / (r * m + 3)
        assert cost.compute_s == plain.compute_s and cost.recomputed_s == plain.recomputed_s
        found = layouts.sends(LLAMA3_70B, layout, BATCH, context=4096, microbatches=m, repeats=r)
        hops = [send.times for send in found if send.kind == "collective-permute"]
        assert hops == [r, r]  # each pass: every microbatch crosses every stage r times
        # the sends but the hops are the 1F1B pipeline's, so the seconds grow by r - 1 hops a pass
        once = layouts.sends(LLAMA3_70B, layout, BATCH, context=4096, microbatches=m)
        assert [s for s in found if s.kind != "collective-permute"] == [
            s for s in once if s.kind != "collective-permute"
        ]


def test_a_pipelines_loop_runs_r_times_as_many_shorter_ticks_and_sends_a_hop_each() -> None:
    layout, tokens = Layout(fsdp=4, pp=4), 2**20
    hop = 2 * tokens / 4 * LLAMA3_70B.width  # a shard's residual stream, bf16
    for m, r in ((4, 2), (8, 5), (64, 20)):
        ticks = r * m + 4 - 1  # pipeline.Pipeline.ticks: r·m work items and the bubble's p - 1
        reduce = 2 * 3 / 4 * hop  # each pass hands the output out once, whatever r
        sent = layouts.bytes_sent(LLAMA3_70B, layout, tokens, microbatches=m, repeats=r)["pp"]
        assert sent == pytest.approx(2 * (ticks * hop / m + reduce))


def test_an_interleaved_stage_holds_p_plus_p_minus_1_over_r_microbatches() -> None:
    # Megatron-LM (theoretical_memory_usage.py): interleaving multiplies 1F1B's p microbatches in
    # flight by 1 + (p-1)/(p·v); its first stage's warm-up: 2(p-1) + (r-1)p + 1 chunks, 1/r a stage
    for p, r in ((4, 2), (16, 4), (64, 2)):
        held = layouts.held_microbatches(p, 4 * p, r)
        warm_up = 2 * (p - 1) + (r - 1) * p + 1  # chunks, each 1/r of the stage's layers
        assert held == pytest.approx(p * (1 + (p - 1) / (p * r))) == warm_up / r
        assert held == in_flight(p, p, r)  # GPipe's count (pipeline.in_flight) of p microbatches
        assert layouts.held_microbatches(p, 4 * p) == p < held  # 1F1B's p: interleaving holds more
    assert layouts.held_microbatches(4, 4, 2) == 4  # no more than the microbatches there are
    layout = Layout(fsdp=4, tp=8, pp=4)
    plain, chunked = (price(LLAMA3_70B, layout, BATCH, "v5p", repeats=r) for r in (1, 2))
    ratio = chunked.memory.terms["activations"] / plain.memory.terms["activations"]
    assert ratio == pytest.approx((4 + 3 / 2) / 4)
    assert chunked.memory.terms["recomputed layer"] == plain.memory.terms["recomputed layer"]


def test_a_pipeline_needs_a_layer_a_stage_no_more_chunks_than_its_layers_and_its_microbatches() -> None:
    with pytest.raises(ValueError, match="pp 160 is more stages than the 80 layers"):
        price(LLAMA3_70B, Layout(fsdp=4, tp=8, pp=160), BATCH, "v5p")
    with pytest.raises(ValueError, match=r"repeats 21 is more chunks than a stage's layers \(20 at most\)"):
        price(LLAMA3_70B, Layout(fsdp=4, tp=8, pp=4), BATCH, "v5p", repeats=21)
    with pytest.raises(ValueError, match="got pp 1"):
        price(LLAMA3_70B, Layout(fsdp=32, tp=8), BATCH, "v5p", repeats=2)
    with pytest.raises(ValueError, match="got pp 16, 2 microbatches"):  # 1,024 sequences / 512
        price(LLAMA3_70B, Layout(dp=256, fsdp=2, pp=16), BATCH, "v5p", repeats=5)
    # the ranking at r lists the pipelines whose stages split evenly into r chunks, and those without pp
    found = layouts.layouts(LLAMA3_70B, POD, repeats=4)
    assert {layout["pp"] for layout in found} == {1, 2, 4, 5, 10, 20}


def test_uneven_stages_run_at_the_fullest_stages_pace_and_it_holds_the_most() -> None:
    """80 layers over 4 stages of 3 chunks: chunks of ceil(80 / 12) = 7 layers, 21 a stage on the
    fullest against 20 on average. Its busy time and its memory are 21/20 of an even stage's; the
    idle places are not the model's FLOPs, so MFU falls by as much."""
    layout = Layout(fsdp=4, tp=8, pp=4)
    even, odd = (price(LLAMA3_70B, layout, BATCH, "v5p", repeats=r) for r in (1, 3))
    assert (even.uneven, odd.uneven) == (1.0, 21 / 20)
    assert odd.step_s == pytest.approx(odd.busy_s * 21 / 20 / (1 - odd.bubble))
    assert odd.mfu == pytest.approx(3 * odd.compute_s / odd.step_s)
    for name in ("parameters", "moments", "gradients"):  # the weights' terms: r does not move them
        assert odd.memory.terms[name] == pytest.approx(even.memory.terms[name] * 21 / 20)


# --- expert parallelism: a new dimension is its rule (styles.DIMENSIONS["ep"]) and its sends ------

MIXTRAL = SIZES["mixtral-8x7b"]


def test_mixtral_counts_its_published_parameters_and_trains_on_its_active_ones() -> None:
    # Jiang et al. 2024, §2: "47B parameters", "13B active parameters during inference"
    assert round(MIXTRAL.params / 1e9, 1) == 46.7 and round(MIXTRAL.active_params / 1e9, 1) == 12.9
    assert MIXTRAL.params - MIXTRAL.expert_params == MIXTRAL.active_params - MIXTRAL.expert_params * 2 // 8
    assert layouts.train_flops(MIXTRAL, 1) == 6 * MIXTRAL.active_params  # 6 FLOPs a routed parameter


def test_ep_is_ranked_only_for_a_mixture_and_divides_its_experts() -> None:
    dense = layouts.layouts(LLAMA3_70B, 64)
    assert all(layout["ep"] == 1 for layout in dense)
    moe = layouts.layouts(MIXTRAL, 64)
    assert {layout["ep"] for layout in moe} == {1, 2, 4, 8}  # 8 experts
    with_ep = [layout for layout in moe if layout["ep"] > 1]
    assert len(moe) == len(set(moe)) and all(layout.devices == 64 for layout in moe) and with_ep


def test_ep_sends_two_all_to_alls_a_layer_each_pass_and_splits_the_experts_memory() -> None:
    tokens, ep = 2**20, Layout(dp=8, ep=8)
    sent = {(send.dimension, send.kind, send.backward): send for send in layouts.sends(MIXTRAL, ep, tokens)}
    routed = 2 * tokens / 64 * MIXTRAL.top_k * MIXTRAL.width  # a device's tokens, each to 2 experts, bf16
    for backward in (False, True):
        all_to_all = sent["ep", "all-to-all", backward]
        assert all_to_all.result_bytes == routed and all_to_all.times == 2 * MIXTRAL.layers
    dense = 2 * (MIXTRAL.params - MIXTRAL.expert_params)  # ep's replicas all-reduce the rest's gradients
    assert sent["ep", "all-reduce", True].result_bytes == dense
    held = MIXTRAL.params - MIXTRAL.expert_params * 7 / 8  # each device: an eighth of the experts
    assert sent["dp", "all-reduce", True].result_bytes == 2 * held
    per_parameter = sum(bytes_per_parameter(MIXED, "adamw").values())
    memory = price(MIXTRAL, ep, tokens, "h100").memory.terms
    assert sum(memory[name] for name in bytes_per_parameter(MIXED, "adamw") if name in memory) == (
        pytest.approx(per_parameter * held)
    )


def test_a_mixture_ranks_expert_parallel_layouts_among_those_that_fit() -> None:
    ranking = rank(MIXTRAL, 4 * 2**20, 512, "h100", context=4096)
    fit = [cost for cost in ranking.costs if cost.fits]
    assert any(cost.layout["ep"] > 1 for cost in fit[:5])
    # the same split without ep, dp in its place, holds every expert: more memory a device
    with_ep = price(MIXTRAL, Layout(dp=64, ep=8), 4 * 2**20, "h100")
    without = price(MIXTRAL, Layout(dp=512), 4 * 2**20, "h100")
    assert with_ep.memory.total < without.memory.total
