"""minishard.memory against the published tables, JAX's saved residuals and the compiler."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals

from minishard import SGD, AdamW, Sharded, composition, make_mesh, megatron_axes, mlp
from minishard import memory as mm
from minishard import precision as mp
from minishard.census import human_bytes
from minishard.costs import Memory
from minishard.hardware import HARDWARE
from minishard.losses import classification_loss
from minishard.memory import bytes_per_parameter, zero_bytes
from minishard.models.gpt import GPT
from minishard.models.vit import ViT
from minishard.precision import FP32, MIXED, Precision
from minishard.run.cli import main, parse_args
from minishard.run.cli.memory import budget, compiled_memory, gathered_early, predict, zero_step_budget
from minishard.run.cli.models import MODELS
from minishard.run.cli.models.gpt import NEXT_CHARACTER
from minishard.run.next_token import next_token_loss
from minishard.run.steps import make_train_step
from minishard.styles import mesh_rules
from minishard.zero import zero_train_step

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


# A compiled ZeRO-1 AdamW step holds Megatron's rows (the weights whole, AdamW's moments and the float32
# master split, to the byte; whole float32 gradients; temporaries that do not shrink with d): docs/memory.md
# compiles the one-block GPT's step at d = 2, 4, 8 in float32 and bfloat16 and asserts it, held formula by
# formula, once (this file compiled the same steps at d = 2, 8 again: 5.75 s).


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
        (lambda: mm.block_activations(1, 1, 1, 1, 1, 1, recompute="some"), "block_activations: recompute"),
    ],
)
def test_bad_input_is_one_line_naming_the_argument(call, says):
    with pytest.raises(ValueError, match=says) as caught:
        call()
    assert "\n" not in str(caught.value)


# --- predicted against compiled ----------------------------------------------------------------

DEVICES = 4  # every style's split divides the default models' 4 heads


def _case(name: str) -> tuple[Any, Any, dict[str, Any], Any]:
    """A default model of the CLI, its optimizer, a batch and its loss."""
    key = jax.random.key(0)
    images = {"label": jnp.zeros(32, jnp.int32)}
    if name == "mlp":
        model = mlp([784, 512, 10], key=key, axes=megatron_axes(2))
        return model, SGD(0.1, momentum=0.9), {"image": jnp.zeros((32, 784)), **images}, classification_loss
    if name == "vit":
        return (
            ViT(key=key),
            SGD(0.1, momentum=0.9),
            {"image": jnp.zeros((32, 28, 28, 1)), **images},
            classification_loss,
        )
    windows = jnp.zeros((16, 64), jnp.int32)
    return GPT(key=key), AdamW(1e-3), {"inputs": windows, "targets": windows}, NEXT_CHARACTER.loss


@functools.cache
def predicted_and_compiled(name: str, style: str, precision: str = "fp32") -> tuple[mm.Budget, Memory]:
    """The budget of a train step that donates its model and state, as ``train`` compiles it, and the
    compiler's ``memory_analysis()``: one compile per model and style, shared by the tests."""
    shape, rules = mesh_rules(style, DEVICES)
    mesh = make_mesh(shape, devices=jax.devices()[:DEVICES])
    model, optimizer, batch, loss = _case(name)
    args, cast = (model, optimizer.init(model), batch), mp.PRECISIONS[precision]
    step = make_train_step(optimizer, loss, precision=None if precision == "fp32" else cast)
    compiled = Sharded(mesh, rules, donate_argnums=(0, 1))(step).lower(*args).compile()
    return budget(args, mesh, rules, cast), Memory.of(compiled)


@dataclasses.dataclass(frozen=True)
class Gap:
    """A known gap between the formula and XLA:CPU's temporaries: predicted / compiled measured at
    ``ratio`` (docs/memory.md's tables), for the reason ``why``. ``check`` holds the ratio within 15% of
    it, as the formula's own cases are held within 15% of 1: a model that moves further fails (tp's
    activations made 4x too large on purpose: the MLP's 1.28 became 2.23, and 7 more cases failed)."""

    ratio: float
    why: str

    def check(self, case: str, predicted: mm.Budget, compiled: Memory) -> None:
        ratio = predicted.temporaries / compiled.temporaries
        print(f"{case}: predicted / compiled temporaries {ratio:.2f}, documented {self.ratio}")
        says = f"{case}: {ratio:.2f}, documented {self.ratio}: {self.why}\n{predicted.table(compiled)}"
        assert 0.85 * self.ratio <= ratio <= 1.15 * self.ratio, says


MORE_KEPT = (
    "where collectives run inside the blocks (all-reduces where heads split, all-gathers under fsdp) they "
    "cut XLA:CPU's fusions: each LayerNorm's intermediates (x - mean, the normalised x and its scaled copy; "
    "4 sbh per norm among JAX's residuals against the 2 a fused norm keeps) stay materialised: 5.3 sbh "
    "more per GPT block under tp over 4"
)
GATHERED_EARLY = (
    "under fsdp XLA:CPU runs each all-gather as soon as its shard is there and keeps the weight whole to "
    "its last use in the backward pass, in float32: at the peak the blocks' weights are whole at once "
    "(4.7 MB of them for the GPT in bf16), where the formula gathers one (0.11 MB); bf16 halves the "
    "formula's activations and gathered weight, not XLA:CPU's float32 weights"
)
FSDP_KEPT = MORE_KEPT + "; " + GATHERED_EARLY
MLP_TP_FUSED = "no gradient is all-reduced, so XLA fuses each into its update: they are never all alive"
CASES = [  # (model, style, the known gap: predicted / compiled as docs/memory.md's table, and why)
    ("mlp", "dp", None),
    ("vit", "dp", None),
    ("gpt", "dp", None),
    ("mlp", "2d", None),
    ("mlp", "fsdp", None),
    ("mlp", "fsdp+tp", None),
    ("mlp", "tp", Gap(1.28, MLP_TP_FUSED)),
    ("vit", "tp", Gap(0.54, MORE_KEPT)),
    ("vit", "2d", Gap(0.68, MORE_KEPT)),
    ("vit", "fsdp+tp", Gap(0.57, FSDP_KEPT)),
    ("gpt", "tp", Gap(0.57, MORE_KEPT)),
    ("gpt", "2d", Gap(0.73, MORE_KEPT)),
    ("gpt", "fsdp+tp", Gap(0.59, FSDP_KEPT)),
    ("vit", "fsdp", Gap(0.57, FSDP_KEPT)),
    ("gpt", "fsdp", Gap(0.57, FSDP_KEPT)),
]


@pytest.mark.parametrize(
    ("name", "style"),
    [
        pytest.param(name, style, marks=() if (name, style) == ("mlp", "dp") else pytest.mark.slow)
        for name, style, _ in CASES
    ],
)
def test_predicted_arguments_are_the_compilers_to_the_byte(name, style):
    predicted, compiled = predicted_and_compiled(name, style)
    assert predicted.arguments == compiled.arguments


@pytest.mark.parametrize(
    ("name", "style"),
    [
        pytest.param(name, style, marks=() if (name, style) == ("mlp", "dp") else pytest.mark.slow)
        for name, style, gap in CASES
        if gap is None
    ],
)
def test_predicted_temporaries_are_the_compilers_within_15_percent(name, style):
    predicted, compiled = predicted_and_compiled(name, style)
    ratio = predicted.temporaries / compiled.temporaries
    print(f"{name} {style}: predicted / compiled temporaries {ratio:.2f}")
    assert 0.85 <= ratio <= 1.15, predicted.table(compiled)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "style", "gap"), [case for case in CASES if case[2] is not None])
def test_where_xla_keeps_otherwise_predicted_temporaries_are_off_by_the_documented_ratio(name, style, gap):
    gap.check(f"{name} {style}", *predicted_and_compiled(name, style))


# The hand-written chapters' styles of the GPT, as explain --memory builds and compiles them: its
# predict (the style's build, a pipeline's schedule) and compiled_memory (train's step from the flags).
LOOP_KEPT = (
    "in the pipeline's loop XLA:CPU keeps, per tick, what JAX's autodiff saves of the stage's blocks, "
    "unfused: 1.78x the formula per block (1.05 M numbers for a block of 4 sequences against 0.59 M: each "
    "LayerNorm's x - mean, normalised and scaled copies, the Swish's input, sigmoid and output, the scores "
    "beside the softmax); the rest (gradients, the head, the loop's carries and their gradients) 1.6-1.9x"
)
EXPERTS_KEPT = (
    "under ep the all-to-alls around the experts cut XLA:CPU's fusions, as the all-reduces do under tp: "
    "each layer's experts keep JAX's residuals of their Swish, 4 E G C H numbers against the formula's 2 "
    "(5.2 MB of the 6 MB); under dp+ep, and dp with the same experts, the formula holds (0.92, 1.09)"
)
SP_KEPT = MORE_KEPT + "; under tp+sp the sequence's reduce-scatters and all-gathers cut more"
CLI_CASES = [  # (style, flags, the known gap as docs/memory.md's table of the chapters' styles says)
    ("cp", (), None),
    ("dp+cp", (), None),
    ("dp+ep", ("--experts", "4"), None),
    ("ep", ("--experts", "4"), Gap(0.75, EXPERTS_KEPT)),
    ("tp+sp", (), Gap(0.50, SP_KEPT)),
    ("pp", ("--microbatches", "4"), Gap(0.56, LOOP_KEPT)),
    ("dp+pp", ("--microbatches", "4"), Gap(0.52, LOOP_KEPT)),
]


@functools.cache
def predicted_and_compiled_by_cli(style: str, flags: tuple[str, ...]) -> tuple[mm.Budget, Memory]:
    """``explain --model gpt --memory --parallel STYLE`` on 4 of the simulated devices, batch 16."""
    args = parse_args(
        [
            "explain",
            "--model",
            "gpt",
            "--memory",
            "--devices",
            str(DEVICES),
            "--parallel",
            style,
            "--batch-size",
            "16",
            *flags,
        ]
    )
    predicted, step_args, shape, rules = predict(args)
    return predicted, compiled_memory(args, step_args, shape, rules, jax.devices()[:DEVICES])


@pytest.mark.slow
@pytest.mark.parametrize(("style", "flags"), [(style, flags) for style, flags, _ in CLI_CASES])
def test_the_chapters_styles_predicted_arguments_are_the_compilers_to_the_byte(style, flags):
    predicted, compiled = predicted_and_compiled_by_cli(style, flags)
    assert predicted.arguments == compiled.arguments


@pytest.mark.slow
@pytest.mark.parametrize(
    ("style", "flags"), [(style, flags) for style, flags, gap in CLI_CASES if gap is None]
)
def test_the_chapters_styles_predicted_temporaries_are_the_compilers_within_15_percent(style, flags):
    predicted, compiled = predicted_and_compiled_by_cli(style, flags)
    ratio = predicted.temporaries / compiled.temporaries
    print(f"gpt {style}: predicted / compiled temporaries {ratio:.2f}")
    assert 0.85 <= ratio <= 1.15, predicted.table(compiled)


@pytest.mark.slow
@pytest.mark.parametrize(("style", "flags", "gap"), [case for case in CLI_CASES if case[2] is not None])
def test_where_xla_keeps_otherwise_the_chapters_styles_are_off_by_the_documented_ratio(style, flags, gap):
    gap.check(f"gpt {style}", *predicted_and_compiled_by_cli(style, flags))


@pytest.mark.slow  # compiles the GPT's cp step twice
def test_under_grouped_queries_the_rings_predicted_temporaries_fall_as_the_compilers_do():
    """At one K/V head of the GPT's 4 (cp on 4 devices, batch 16), K and V and their chunks in
    flight are a quarter as large: the prediction falls (2.36 MB) as the compiled temporaries
    do (2.07 MB), within 15%, and stays within 15% of them."""
    grouped = ("--kv-heads", "1")
    (before, compiled_before), (after, compiled_after) = (
        predicted_and_compiled_by_cli("cp", flags) for flags in ((), grouped)
    )
    fall = before.temporaries - after.temporaries
    compiled_fall = compiled_before.temporaries - compiled_after.temporaries
    falls = f"predicted {fall / 1e6:.2f} MB, compiled {compiled_fall / 1e6:.2f} MB"
    print(f"kv_heads 4 -> 1: the temporaries fall {falls}")
    assert 0.85 <= fall / compiled_fall <= 1.15
    ratio = after.temporaries / compiled_after.temporaries
    assert 0.85 <= ratio <= 1.15, after.table(compiled_after)


def test_under_grouped_queries_the_ring_and_its_blocks_keep_k_and_v_at_their_heads():
    """The GPT (4 heads of 32, 16 tokens a device under cp on 4 devices, batch 16) with 1 K/V head:
    its blocks keep k and v of 1 head, and 8 of the ring's 9 chunks in flight have 1 head (the dQ
    has 4); nothing compiled."""

    def terms(*flags: str) -> dict[str, float]:
        argv = ["explain", "--model", "gpt", "--memory", "--devices", "4", "--parallel", "cp"]
        return predict(parse_args([*argv, "--batch-size", "16", *flags]))[0].terms

    grouped, ungrouped = terms("--kv-heads", "1"), terms()
    assert grouped["ring K/V"] == 4 * composition.ring_in_flight(16, 16, 4, 32, kv_heads=1)
    assert grouped["ring K/V"] == ungrouped["ring K/V"] * (8 * 1 + 4) / (9 * 4)
    k_and_v = 4 * 2 * 16 * 16 * 32  # one block's k and v of one head, float32 bytes
    assert ungrouped["activations"] - grouped["activations"] == 4 * (4 - 1) * k_and_v  # 4 blocks
    assert k_and_v * (4 - 1) == 4 * mm.grouped_kv(16, 16, heads=4, kv_heads=1, head_dim=32)


@pytest.mark.parametrize("policy", ["none", "full", "names", "dots"])
def test_grouped_keys_and_values_are_kept_at_their_heads_under_each_remat_policy(policy):
    """The GPT (4 blocks, 4 heads of 32, 64 tokens; 4 sequences a device under dp on 4 devices) with
    1 K/V head: each block's k and v that the policy keeps have 1 head (memory.grouped_kv); the
    block recomputed at a time keeps them all (none's); nothing compiled."""

    def activations(*flags: str) -> float:
        argv = ["explain", "--model", "gpt", "--memory", "--devices", "4", "--parallel", "dp"]
        budget = predict(parse_args([*argv, "--batch-size", "16", "--remat", policy, *flags]))[0]
        return budget.terms["activations"]

    fewer = mm.grouped_kv(b=4, s=64, heads=4, kv_heads=1, head_dim=32)
    assert fewer == 2 * 4 * 64 * (4 - 1) * 32
    kept_fewer = 0 if policy == "full" else fewer
    float32 = 4
    # 4 blocks keep what the policy keeps; the last recomputed one what none keeps, whole: 3 + 1
    assert activations() - activations("--kv-heads", "1") == float32 * (3 * kept_fewer + fewer)


def test_each_style_adds_its_own_terms_as_its_chapter_counts_them():
    """A pipeline keeps its stage's blocks of pipeline.in_flight microbatches: 4 microbatches over 4
    stages keep 7 of one block's, 16 keep 19 (not 4 times as many: the bubble's 3 stay); the ring
    keeps no softmax and adds its chunks in flight; the experts keep their slots; nothing compiled."""

    def terms(style: str, *flags: str) -> dict[str, float]:
        argv = ["explain", "--model", "gpt", "--memory", "--devices", "4", "--parallel", style, *flags]
        return predict(parse_args(argv))[0].terms

    few, many = (terms("pp", "--batch-size", "64", "--microbatches", m)["activations"] for m in ("4", "16"))
    head = 4 * mm.head_activations(64, 64, 128, 64 * 65)
    block = 4 * mm.block_activations(64 // 16, 64, 128, 4, 32, 512)  # a microbatch of 16 through one block
    assert (few - head, many - head) == (7 * 4 * block, 19 * block)
    ring, dense = terms("cp", "--batch-size", "16"), terms("dp", "--devices", "1", "--batch-size", "16")
    assert ring["ring K/V"] == 4 * composition.ring_in_flight(16, 16, 4, 32)
    assert "ring K/V" not in dense and ring["activations"] < dense["activations"] / 4  # and no softmax
    moe = terms("ep", "--batch-size", "16", "--experts", "4")["activations"]
    assert moe > terms("dp", "--batch-size", "16")["activations"]  # 4 sequences a device each


# ZeRO by hand (minishard.zero), its own step, as explain --memory --parallel zero builds it on 8
# devices (the CLI's ZeRO-3 in float32; levels 1 and 2, and bfloat16, from Python): predicted from the
# step's placed shapes on an AbstractMesh, compiled from ZeroStep.lower on the simulated devices.
ZERO_DEVICES = 8
CONVERTED = (
    "XLA:CPU has no bfloat16 matmul: it converts each bfloat16 weight to float32 for its dot and keeps "
    "the copies for the backward pass; the MLP's first gradient is written twice, f32[512,784] by the "
    "dot (transposed) and row-major for the reduce-scatter (3.2 MB, the whole peak)"
)
STAND_IN = (
    "XLA:CPU's peak is at the backward pass's start: what the forward pass left for it (7.4 MB, 1.5x the "
    "formula's activations) and the gathered weights; the whole gradients come after, in the place of "
    "what the backward is done with, and stand in for the excess; under --remat full there is none"
)
ZERO_CASES = [  # level 2 runs level 1's code (minishard.zero), and zero_budget prices them alike
    *[(name, level, "float32", (), None) for name in ("mlp", "gpt") for level in (1, 3)],
    ("mlp", 1, "bfloat16", (), Gap(0.59, CONVERTED)),  # docs/memory.md's table of ZeRO
    ("gpt", 1, "bfloat16", (), None),  # 0.83 before context.narrow_attend kept the softmax in bf16
    ("gpt", 3, "float32", ("--remat", "full"), Gap(1.50, STAND_IN)),
]


@functools.cache
def zero_predicted_and_compiled(
    name: str, level: int, compute: str, flags: tuple[str, ...] = ()
) -> tuple[mm.Budget, Memory]:
    """ZeRO's step at ``level`` in ``compute`` of the CLI's default model, with the CLI's batch."""
    args = parse_args(["explain", "--model", name, "--memory", "--parallel", "zero", *flags])
    entry = MODELS[name]
    model = jax.eval_shape(lambda: entry.build(args, jax.random.key(0)))
    batch = entry.example(args, args.batch_size)

    def step(mesh: Any) -> Any:
        optimizer = entry.compiled_optimizer(args)
        return zero_train_step(optimizer, mesh, level=level, loss=entry.task.loss, compute=compute)

    abstract = jax.sharding.AbstractMesh((ZERO_DEVICES,), ("data",))
    predicted = zero_step_budget(step(abstract), model, batch, mesh_rules("dp", ZERO_DEVICES)[1])
    compiled = step(make_mesh({"data": ZERO_DEVICES}, devices=jax.devices()[:ZERO_DEVICES]))
    return predicted, Memory.of(compiled.lower(*compiled.placed_shapes(model), batch).compile())


def _zero_marks(name: str, level: int, compute: str) -> Any:
    quick = (name, level, compute) == ("mlp", 3, "float32")  # what explain --memory --parallel zero runs
    return () if quick else pytest.mark.slow


@pytest.mark.parametrize(
    ("name", "level", "compute", "flags"),
    [pytest.param(*case[:4], marks=_zero_marks(*case[:3])) for case in ZERO_CASES],
)
def test_zeros_predicted_arguments_are_the_compilers_to_the_byte(name, level, compute, flags):
    """The weights whole (or 1/8, each padded by flat_padded), the state and master 1/8, the batch 1/8."""
    predicted, compiled = zero_predicted_and_compiled(name, level, compute, flags)
    assert predicted.arguments == compiled.arguments


@pytest.mark.parametrize(
    ("name", "level", "compute", "flags"),
    [pytest.param(*case[:4], marks=_zero_marks(*case[:3])) for case in ZERO_CASES if case[4] is None],
)
def test_zeros_predicted_temporaries_are_the_compilers_within_15_percent(name, level, compute, flags):
    predicted, compiled = zero_predicted_and_compiled(name, level, compute, flags)
    ratio = predicted.temporaries / compiled.temporaries
    print(f"{name} ZeRO-{level} {compute} {' '.join(flags)}: predicted / compiled temporaries {ratio:.2f}")
    assert 0.85 <= ratio <= 1.15, predicted.table(compiled)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "level", "compute", "flags", "gap"), [case for case in ZERO_CASES if case[4] is not None]
)
def test_where_xla_keeps_otherwise_zeros_temporaries_are_off_by_the_documented_ratio(
    name, level, compute, flags, gap
):
    case = f"{name} ZeRO-{level} {compute} {' '.join(flags)}"
    gap.check(case, *zero_predicted_and_compiled(name, level, compute, flags))


def test_zeros_levels_split_what_their_stage_splits():
    """Against the same step at level 1: level 3 holds 1/8 of the weights (padded) and gathers the
    pieces; bfloat16 holds the weights in 2 bytes and a float32 master 1/8; nothing compiled."""

    def planned(level: int, compute: str = "float32") -> mm.Budget:
        args = parse_args(["explain", "--model", "gpt", "--memory", "--parallel", "zero"])
        entry, mesh = MODELS["gpt"], jax.sharding.AbstractMesh((ZERO_DEVICES,), ("data",))
        model = jax.eval_shape(lambda: entry.build(args, jax.random.key(0)))
        optimizer, batch = entry.compiled_optimizer(args), entry.example(args, args.batch_size)
        step = zero_train_step(optimizer, mesh, level=level, loss=entry.task.loss, compute=compute)
        return zero_step_budget(step, model, batch, mesh_rules("dp", ZERO_DEVICES)[1])

    def terms(level: int, compute: str = "float32") -> dict[str, float]:
        return planned(level, compute).terms

    one, three, bf16 = terms(1), terms(3), terms(1, "bfloat16")
    assert terms(2) == one and terms(2, "bfloat16") == bf16  # level 2 runs level 1's code
    psi = 816_193  # the default GPT's parameters
    padded = sum(-(-leaf.size // ZERO_DEVICES) for leaf in jax.tree.leaves(GPT(key=jax.random.key(0))))
    assert (one["parameters"], three["parameters"], bf16["parameters"]) == (4 * psi, 4 * padded, 2 * psi)
    assert one["optimizer state"] == three["optimizer state"] == 2 * 4 * padded + 4  # and its step count
    assert "master" not in one and bf16["master"] == 4 * padded
    assert one["gradients"] == three["gradients"] == three["gathered"] == 4 * psi  # the GPT: one piece
    assert "gathered" not in one and bf16["activations"] == one["activations"] / 2 == three["activations"] / 2

    # Too big for a 1 MB chip: ZeRO-3 would split level 1's whole weights and gradients, not its state again
    tiny = dataclasses.replace(HARDWARE["h100"], hbm_bytes=1e6)
    level1 = planned(1)
    zero3 = level1.total - (one["parameters"] + one["gradients"]) * (1 - 1 / ZERO_DEVICES)
    assert level1.verdict(tiny, ZERO_DEVICES).endswith(f"ZeRO-3 over 8 would need {human_bytes(int(zero3))}")
    assert planned(3).verdict(tiny, ZERO_DEVICES).endswith("its state is already split over the 8 devices")


def test_explain_memory_predicts_zeros_own_step_beside_the_compiled_one(capsys):
    assert main(["explain", "--parallel", "zero", "--memory", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    for term in (
        "parameters",
        "optimizer state",
        "gradients",
        "reduced gradients",
        "gathered",
        "activations",
    ):
        assert term in rows, out
    assert "(1.00x)" in rows["arguments"], out  # the arguments to the byte
    assert out.splitlines()[0].startswith("mlp (407,050 parameters) under zero on 8 devices"), out
    assert out.strip().splitlines()[-1].startswith("fits on one H100: "), out
    predicted = predict(parse_args(["explain", "--parallel", "zero", "--memory"]))[0]
    assert predicted == zero_predicted_and_compiled("mlp", 3, "float32")[0]  # the CLI's is ZeRO-3's


# --- recomputation ----------------------------------------------------------------------------


def _saved(remat: str, capsys: Any) -> list[str]:
    """What autodiff saves for the backward pass of a small GPT's loss (``print_saved_residuals``),
    less the parameters it reads back."""
    model = GPT(vocab=65, context=16, width=32, depth=2, heads=2, key=jax.random.key(0), remat=remat)
    windows = jnp.zeros((3, 16), jnp.int32)
    print_saved_residuals(lambda m: next_token_loss(m, {"inputs": windows, "targets": windows})[0], model)
    return [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]


def test_full_recomputation_keeps_only_each_blocks_input(capsys):
    kept = _saved("full", capsys)
    inside = [line for line in kept if "attention.py" in line or "layers.py" in line]
    inputs = [line for line in kept if line.startswith("f32[3,16,32]") and "LayerNorm" not in line]
    assert not inside, inside  # nothing of attention, the MLP or the Swish: recomputed
    assert [line.split(" (")[-1] for line in inputs] == ["Embedding.__call__)", "Block.residual_mlp)"]
    assert any("attention.py" in line for line in _saved("none", capsys))  # without: the softmax and more


# --- minishard explain --memory --------------------------------------------------------------


def test_explain_memory_sets_each_term_beside_the_compiled_step(capsys):
    assert main(["explain", "--model", "mlp", "--parallel", "dp", "--memory", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    for term in ("parameters", "optimizer state", "gradients", "reduced gradients", "activations"):
        assert term in rows, out
    assert "(1.00x)" in rows["arguments"], out  # the arguments to the byte
    assert out.strip().splitlines()[-1].startswith("fits on one H100: "), out


def test_explain_memory_gives_a_7b_gpt_a_verdict_without_compiling(capsys):
    shape = ["--width", "4096", "--depth", "32", "--heads", "32", "--context", "4096"]
    flags = ["--parallel", "fsdp", "--devices", "64", "--hardware", "h100", "--memory"]
    assert main(["explain", "--model", "gpt", *shape, *flags]) == 0
    out = capsys.readouterr().out
    assert "gpt (6,460,948,545 parameters) under fsdp on 64 devices" in out
    assert "not compiled here" in out and "compiled" not in out.splitlines()[1]
    assert out.strip().splitlines()[-1].startswith("does not fit: "), out  # 103 GB of activations
    assert main(["explain", "--model", "gpt", *shape, *flags, "--remat", "full"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("fits on one H100: ")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--parallel", "dp+tp+pp"], "argument --memory: it predicts the step of dp, tp, 2d, fsdp, fsdp+tp"),
        (["--parallel", "zero", "--precision", "bf16"], "argument --precision: bf16 casts Sharded's step"),
        (["--parallel", "zero", "--model", "gpt", "--precision", "fp16"], "argument --precision: fp16"),
        (["--parallel", "zero", "--microbatches", "2"], "argument --microbatches: --parallel zero's step"),
        (["--model", "gpt", "--parallel", "dp+tp+pp"], "ep, dp+ep, zero, not --parallel dp+tp+pp's"),
        (["--compare", "--hardware", "h100"], "argument --memory: one style at a time"),
        (["--model", "gpt", "--parallel", "pp", "--remat", "full"], "argument --remat: not with a pipeline"),
        (["--model", "gpt", "--heads", "3"], "argument --heads: 3 heads must divide --width 128"),
        (["--model", "gpt", "--parallel", "tp", "--heads", "2"], "argument --heads: 2 heads cannot split"),
    ],
)
def test_explain_memory_refuses_bad_flags_in_one_line(flags, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["explain", "--memory", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err, err
    assert err.strip().splitlines()[-1].startswith("minishard explain: error:")


@pytest.mark.slow
def test_each_gpt_block_adds_its_activations_and_gradients_to_the_compiled_step():
    """Under dp the compiled temporaries grow per block by the formula's activations and the block's
    gradients twice (the all-reduce's sum beside its summands), to 1%: the fixed rest of the step apart.
    Depth 4 is the default GPT's dp step of 16 windows, compiled once for the module by
    predicted_and_compiled; depth 2 is the same step built the same way."""
    shape, rules = mesh_rules("dp", DEVICES)
    mesh = make_mesh(shape, devices=jax.devices()[:DEVICES])
    windows = jnp.zeros((16, 64), jnp.int32)
    model, optimizer = GPT(key=jax.random.key(0), depth=2), AdamW(1e-3)
    step = Sharded(mesh, rules, donate_argnums=(0, 1))(make_train_step(optimizer, next_token_loss))
    lowered = step.lower(model, optimizer.init(model), {"inputs": windows, "targets": windows})
    temporaries = {2: Memory.of(lowered.compile()).temporaries}
    temporaries[4] = predicted_and_compiled("gpt", "dp")[1].temporaries
    assert len(_case("gpt")[0].blocks) == 4 and NEXT_CHARACTER.loss is next_token_loss  # the same step
    block = GPT(key=jax.random.key(0), depth=1).blocks[0]
    gradients = 2 * 4 * sum(leaf.size for leaf in jax.tree.leaves(block))
    activations = 4 * mm.block_activations(16 // DEVICES, 64, 128, 4, 32, 512)
    per_block = (temporaries[4] - temporaries[2]) / 2
    assert activations + gradients == pytest.approx(per_block, rel=0.01)


@pytest.mark.slow
def test_the_gpt_under_fsdp_computes_on_its_own_examples():
    """The embedding's output is pinned to the activations' sharding: left to XLA it took the token
    table's (embed over data) and every device computed the whole batch, 2.5x dp's temporaries."""
    fsdp, dp = (predicted_and_compiled("gpt", style)[1].temporaries for style in ("fsdp", "dp"))
    assert fsdp < 1.25 * dp


@functools.cache
def explained_fsdp_bf16(*flags: str) -> tuple[mm.Budget, Memory, Any, dict[str, int], Any]:
    """``explain --model gpt --memory --parallel fsdp --precision bf16`` on 8 devices, batch 16."""
    argv = ["explain", "--model", "gpt", "--memory", "--parallel", "fsdp", "--precision", "bf16", *flags]
    args = parse_args(argv)
    predicted, step_args, shape, rules = predict(args)
    return predicted, compiled_memory(args, step_args, shape, rules), step_args[0], shape, rules


@pytest.mark.slow  # three compiles of the GPT's fsdp step on 8 devices
def test_under_fsdp_xla_cpu_keeps_every_weight_gathered_so_recomputation_leaves_its_peak():
    """docs/memory.md: the bf16 gap is its documented 0.39; the compiled temporaries hold at least the
    formula's, less its one gathered weight, plus every weight whole in float32; --remat full and dots,
    whose activations the formula tells apart 2.5 times, compile to the same temporaries, to 5%."""
    none, full, dots = (
        explained_fsdp_bf16(*flags) for flags in ((), ("--remat", "full"), ("--remat", "dots"))
    )
    Gap(0.39, GATHERED_EARLY).check("gpt fsdp bf16", none[0], none[1])
    weights = 4 * sum(leaf.size for leaf in jax.tree.leaves(none[2]))  # every weight whole, float32
    for predicted, compiled, *_ in (none, full, dots):
        assert compiled.temporaries >= predicted.temporaries - predicted.terms["gathered"] + weights
    assert full[0].terms["activations"] < dots[0].terms["activations"] / 2
    assert full[1].temporaries == pytest.approx(dots[1].temporaries, rel=0.05)
    note = gathered_early(*none[:2], *none[2:], "bf16")
    assert note == (
        f"(XLA:CPU gathers each weight ahead of its use and keeps it whole to the backward pass, in float32: "
        f"{human_bytes(weights)} where 'gathered' holds one, and --remat cannot lower that; in bf16 it "
        "keeps float32 copies of activations too: docs/memory.md)"
    )


def test_explain_memory_explains_gathered_weights_only_where_the_gap_appears():
    """The line comes under FSDP (a 'gathered' term) where the compiled temporaries exceed the predicted
    ones by more than 15%; nothing compiled here."""
    args = parse_args(["explain", "--model", "gpt", "--memory", "--parallel", "fsdp", "--devices", "8"])
    predicted, step_args, shape, rules = predict(args)
    near, far = (Memory(0, 0, int(predicted.temporaries * ratio)) for ratio in (1.15, 2))
    assert gathered_early(predicted, near, step_args[0], shape, rules, "fp32") is None
    assert gathered_early(predicted, None, step_args[0], shape, rules, "fp32") is None  # not compiled
    assert "3.3 MB where 'gathered' holds one" in gathered_early(
        predicted, far, step_args[0], shape, rules, "fp32"
    )
    dp = parse_args(["explain", "--model", "gpt", "--memory", "--parallel", "dp", "--devices", "8"])
    predicted, step_args, shape, rules = predict(dp)
    assert gathered_early(predicted, far, step_args[0], shape, rules, "fp32") is None  # nothing gathered


# --- mixed precision ------------------------------------------------------------------------------


def test_a_bf16_step_computes_in_bfloat16_on_the_float32_master():
    model, optimizer = (
        GPT(vocab=65, context=16, width=32, depth=2, heads=2, key=jax.random.key(0)),
        AdamW(1e-3),
    )
    windows = jax.random.randint(jax.random.key(1), (4, 16), 0, 65)
    args = (model, optimizer.init(model), {"inputs": windows, "targets": windows})
    bf16 = make_train_step(optimizer, next_token_loss, precision=mp.BF16)
    # Every matrix product multiplies bfloat16 by bfloat16, forward and backward, attention's too
    # (context.F32: bf16 in, float32 sums out), the softmax's gradient [4, 2, 16, 16] (the scores'
    # shape) included: context.narrow_attend's backward gives it to the matrix unit in bf16.
    products = _products(jax.make_jaxpr(bf16)(*args).jaxpr)
    scores = (4, 2, 16, 16)  # [batch, heads, query, key]
    assert {dtypes for dtypes, _ in products} == {("bfloat16", "bfloat16")}
    assert any(scores in shapes for _, shapes in products)  # attention's, read as they are
    fp32 = _products(jax.make_jaxpr(make_train_step(optimizer, next_token_loss))(*args).jaxpr)
    assert len(products) == len(fp32) and {dtypes for dtypes, _ in fp32} == {("float32", "float32")}
    (new, _, loss, _), (_, _, reference, _) = (
        jax.jit(bf16)(*args),
        jax.jit(make_train_step(optimizer, next_token_loss))(*args),
    )
    assert {leaf.dtype for leaf in jax.tree.leaves(new)} == {jnp.dtype("float32")}  # the master stays
    assert loss.dtype == jnp.float32 and abs(float(loss) - float(reference)) < 0.02


def _products(jaxpr: Any) -> list[tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]]:
    """Each ``dot_general`` of ``jaxpr`` and of the programs inside it: its operands' dtypes, and the
    shapes of its operands and result."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes = tuple(v.aval.shape for v in (*eqn.invars, *eqn.outvars))
            found.append((tuple(str(v.aval.dtype) for v in eqn.invars), shapes))
        for param in eqn.params.values():
            for inner in param if isinstance(param, list | tuple) else [param]:
                if isinstance(inner, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    found += _products(getattr(inner, "jaxpr", inner))
    return found


@pytest.mark.slow
def test_a_bf16_steps_arguments_hold_the_master_and_its_activations_halve():
    predicted, compiled = predicted_and_compiled("gpt", "dp", "bf16")
    assert predicted.arguments == compiled.arguments  # the float32 model, its moments, the batch
    # XLA:CPU has no bfloat16 arithmetic: it computes in float32 between converts, and keeps some of
    # those copies: 0.89 for this step of 16 sequences, 0.98 for explain --memory's of 12, at either
    # optimisation level (0, the suite's, or XLA's default).
    assert 0.75 <= predicted.temporaries / compiled.temporaries <= 1.15, predicted.table(compiled)
    assert predicted.terms["activations"] == predicted_and_compiled("gpt", "dp")[0].terms["activations"] / 2


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (
            ["train", "--precision", "fp8"],
            "argument --precision: invalid choice: 'fp8' (choose from 'fp32', 'bf16', 'fp16')",
        ),
        (
            ["train", "--precision", "bf16", "--parallel", "zero"],
            "argument --precision: bf16 casts Sharded's step",
        ),
        (["explain", "--precision", "bf16"], "argument --precision: only with --memory or --hardware"),
    ],
)
def test_precision_refuses_what_it_cannot_honour_in_one_line(command, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(command)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err, err
