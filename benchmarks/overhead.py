"""What does minishard's ``Sharded`` cost on top of a hand-written ``jax.jit``?

``Sharded`` is a thin layer over ``jax.jit``: on every call it flattens the
arguments, builds a cache key and looks up a ``jax.jit`` it built earlier with
derived ``in_shardings`` / ``out_shardings``. This script measures that layer.

1. **Train step, Sharded vs jit.** The same SGD train step on the same
   minishard MLP, once through ``Sharded`` and once through a ``jax.jit`` we
   write by hand with *the same* ``NamedSharding``s (taken from
   ``ShardedFunction.specs``; the script checks that both lower to the same
   program). So the ratio isolates the wrapper. Two sizes: ``[784, 64, 10]``
   with batch 8 (dispatch-bound: Python overhead shows) and ``[784, 512, 10]``
   with batch 128 (more compute).
2. **Flatten cost.** ``jax.tree_util.tree_flatten`` / ``tree_unflatten`` of the
   minishard MLP next to a raw-JAX ``[(w, b), ...]`` list, Equinox and Flax NNX.
3. **Sharded's Python prelude.** The work ``ShardedFunction.__call__`` does
   before it calls the jitted function (flatten + key + lookup), measured directly.

Method. The machine is shared and noisy, so every comparison is

* **interleaved**: the contenders take turns in one process (A, B, C, then
  A, C, B, ...: every order in turn), so a burst of load from elsewhere hits
  all of them, and none always runs right after the same neighbour;
* **paired**: a ratio compares the two contenders' steps *of the same
  iteration*, then takes the median of those per-iteration ratios;
* **repeated**: many iterations per round, several rounds;
* **summarised by medians**: the median per round, then the median of those
  round medians (outliers from the scheduler or GC barely move a median);
* **controlled**: an A/A contender (a second, identical ``jax.jit``) shows
  how far apart two *equal* programs land: differences below that are noise.

Timing one step: ``t0; out = fn(...); t1; jax.block_until_ready(out); t2``.
``t1 - t0`` is the *host time* (until the call returns: Python + dispatch);
``t2 - t0`` is the *step time*. We block after every call on purpose: queueing
many sharded programs with collectives on simulated CPU devices can deadlock
XLA's in-process rendezvous.

Run with ``make bench`` (or ``python benchmarks/overhead.py``; ``--quick`` for
a short run, ``--strict`` to exit 1 when a target fails).
"""

from __future__ import annotations

import os

# XLA reads this once, when JAX first initialises its backend: set it before importing jax.
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import argparse  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

import minishard as ms  # noqa: E402
from minishard.sharding import ShardedFunction  # noqa: E402

TARGET_RATIO = 1.05  # Sharded step time / hand-written jit step time
MEGATRON_AXES = [("embed", "mlp"), ("mlp", "embed")]
NUM_CLASSES = 10
SHARDED, REFERENCE, CONTROL = "Sharded", "jax.jit", "jax.jit copy"  # the train-step contenders


@dataclass(frozen=True)
class Case:
    """One model size and batch size for the train-step benchmark."""

    sizes: tuple[int, ...]
    batch: int


CASES = (
    Case((784, 64, 10), 8),  # little compute: the step is dispatch-bound, so Python overhead shows
    Case((784, 512, 10), 128),  # more compute per step
)


# --- set-up ------------------------------------------------------------------


def make_mesh_and_rules() -> tuple[Mesh, ms.AxisRules]:
    """A 2x4 mesh: the batch is split 2 ways, the MLP's hidden dimension 4 ways (Megatron)."""
    mesh = ms.make_mesh({"data": 2, "model": 4})
    rules = ms.AxisRules(batch="data", embed=None, mlp="model")
    return mesh, rules


OPTIMIZER = ms.SGD(0.1, momentum=0.9)


def train_step(model: Any, opt_state: ms.SGDState, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
    """One SGD step: forward, cross-entropy, gradient, momentum update."""

    def loss_fn(m: Any) -> jax.Array:
        return ms.cross_entropy(m(x), ms.one_hot(y, NUM_CLASSES))

    loss, grads = jax.value_and_grad(loss_fn)(model)
    model, opt_state = OPTIMIZER.update(model, grads, opt_state)
    return model, opt_state, loss


def make_args(case: Case) -> tuple[Any, ...]:
    """(model, opt_state, x, y) for one case, not yet placed on the mesh."""
    model = ms.mlp(list(case.sizes), key=jax.random.key(0), axes=MEGATRON_AXES)
    x = jax.random.normal(jax.random.key(1), (case.batch, case.sizes[0]))
    y = jax.random.randint(jax.random.key(2), (case.batch,), 0, NUM_CLASSES)
    return model, OPTIMIZER.init(model), x, y


def to_named(specs: Any, mesh: Mesh) -> Any:
    """PartitionSpec leaves -> NamedSharding leaves (None, "left to XLA", stays None)."""
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs)


def build_contenders(case: Case) -> tuple[dict[str, Callable[..., Any]], tuple[Any, ...]]:
    """The Sharded step, hand-written jits with identical shardings, and placed arguments.

    Two hand-written jits: ``jax.jit`` is the reference, ``jax.jit copy`` is an
    A/A control (the same thing again), whose ratio to the reference shows how
    far apart two *identical* contenders land on this machine: the noise floor.
    """
    mesh, rules = make_mesh_and_rules()
    sharded = ms.Sharded(mesh, rules)(train_step)
    args = make_args(case)
    specs = sharded.specs(*args)
    in_shardings, out_shardings = to_named(specs.inputs, mesh), to_named(specs.outputs, mesh)
    hand_jit = jax.jit(train_step, in_shardings=in_shardings, out_shardings=out_shardings)
    control = jax.jit(train_step, in_shardings=in_shardings, out_shardings=out_shardings)
    placed = jax.device_put(args, in_shardings)
    if sharded.lower(*placed).as_text() != hand_jit.lower(*placed).as_text():
        print("WARNING: Sharded and the hand-written jit lower to different programs", file=sys.stderr)
    return {SHARDED: sharded, REFERENCE: hand_jit, CONTROL: control}, placed


# --- timing helpers ----------------------------------------------------------


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect garbage first, then keep the collector out of the timed region."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_step(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[float, float, Any]:
    """(host seconds, step seconds, output) of one call, blocking before returning."""
    t0 = time.perf_counter()
    out = fn(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0, out


def median_us(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e6


def rotated(names: Sequence[str], i: int) -> list[str]:
    """``names`` starting at position ``i``: over many iterations everyone goes first equally often."""
    i %= len(names)
    return [*names[i:], *names[:i]]


@dataclass
class Samples:
    """Per-call host and step times (seconds) of one contender in one round."""

    host: list[float]
    step: list[float]


def paired_round(fns: dict[str, Callable[..., Any]], args: tuple[Any, ...], iters: int) -> dict[str, Samples]:
    """``iters`` iterations; in each, every contender takes one train step, in changing order.

    Each contender carries its own (model, opt_state) from step to step, like a
    real training loop; the batch stays the same. Sample ``i`` of every
    contender comes from the same iteration, so they can be compared in pairs.
    """
    state = dict.fromkeys(fns, args)
    samples = {name: Samples([], []) for name in fns}
    orders = list(itertools.permutations(fns))  # each contender goes before each other equally often
    with no_gc():
        for i in range(iters):
            for name in orders[i % len(orders)]:
                host, step, (model, opt_state, _) = time_step(fns[name], state[name])
                state[name] = (model, opt_state, *args[2:])
                samples[name].host.append(host)
                samples[name].step.append(step)
    return samples


def paired_ratio(a: Samples, b: Samples) -> float:
    """Median over iterations of a's step time / b's step time in the same iteration."""
    return statistics.median(x / y for x, y in zip(a.step, b.step))


# --- 1. train step: Sharded vs hand-written jit -------------------------------


@dataclass
class StepResult:
    """One case: medians of round medians (microseconds) and paired ratios to the reference jit."""

    case: Case
    step_us: dict[str, float]
    host_us: dict[str, float]
    ratio: dict[str, float]
    ratio_range: dict[str, tuple[float, float]]


def bench_step(case: Case, rounds: int, iters: int, warmup: int) -> StepResult:
    fns, args = build_contenders(case)
    paired_round(fns, args, warmup)  # compile, fill caches
    step: dict[str, list[float]] = {name: [] for name in fns}
    host: dict[str, list[float]] = {name: [] for name in fns}
    ratios: dict[str, list[float]] = {name: [] for name in (SHARDED, CONTROL)}
    for _ in range(rounds):
        samples = paired_round(fns, args, iters)
        for name, s in samples.items():
            step[name].append(median_us(s.step))
            host[name].append(median_us(s.host))
        for name in ratios:
            ratios[name].append(paired_ratio(samples[name], samples[REFERENCE]))
    return StepResult(
        case,
        step_us={name: statistics.median(m) for name, m in step.items()},
        host_us={name: statistics.median(m) for name, m in host.items()},
        ratio={name: statistics.median(r) for name, r in ratios.items()},
        ratio_range={name: (min(r), max(r)) for name, r in ratios.items()},
    )


def print_step_results(results: Sequence[StepResult]) -> bool:
    """Print the table; True when every case meets the target."""
    print(f"\n== 1. Train step: {SHARDED} vs a hand-written {REFERENCE} with the same NamedShardings")
    print("      mesh data=2 x model=4, Megatron MLP, SGD with momentum")
    header = (
        f"{'layers':<16}{'batch':>6}{'step Sharded':>14}{'step jit':>10}{'ratio':>7} {'(rounds)':<14}"
        f"{'A/A':>6}{'host Sharded':>14}{'host jit':>10}{'diff':>9}  target"
    )
    print(header)
    print("-" * len(header))
    all_pass = True
    for r in results:
        ok = r.ratio[SHARDED] <= TARGET_RATIO
        all_pass &= ok
        lo, hi = r.ratio_range[SHARDED]
        host_diff = r.host_us[SHARDED] - r.host_us[REFERENCE]
        print(
            f"{list(r.case.sizes)!s:<16}{r.case.batch:>6}{r.step_us[SHARDED]:>12.0f}us"
            f"{r.step_us[REFERENCE]:>8.0f}us{r.ratio[SHARDED]:>7.3f} {f'({lo:.2f}-{hi:.2f})':<14}"
            f"{r.ratio[CONTROL]:>6.3f}{r.host_us[SHARDED]:>12.0f}us{r.host_us[REFERENCE]:>8.0f}us"
            f"{host_diff:>+7.0f}us  {'PASS' if ok else 'FAIL'} (<= {TARGET_RATIO})"
        )
    print(
        "step: call + block_until_ready; host: until the call returns (medians of round medians).\n"
        "ratio: Sharded / jit step time, paired per iteration (median over iterations, then over\n"
        "rounds; the range of the round values in brackets). A/A: the same for a second, identical\n"
        "jax.jit: how far apart two equal contenders land on this machine (the noise floor)."
    )
    return all_pass


# --- 2. flatten / unflatten cost ---------------------------------------------


@dataclass(frozen=True)
class FlattenCase:
    """How to flatten and unflatten one model representation."""

    name: str
    flatten: Callable[[], Any]
    unflatten: Callable[[], Any]
    num_leaves: int


def tree_case(name: str, tree: Any) -> FlattenCase:
    """A row that uses ``jax.tree_util`` on ``tree``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return FlattenCase(
        name,
        lambda: jax.tree_util.tree_flatten(tree),
        lambda: jax.tree_util.tree_unflatten(treedef, leaves),
        len(leaves),
    )


def flatten_cases(sizes: Sequence[int]) -> list[FlattenCase]:
    """The same MLP (Linear, swish, Linear) in each library; skips libraries that are missing."""
    key = jax.random.key(0)
    model = ms.mlp(list(sizes), key=key, axes=MEGATRON_AXES)
    raw = [(layer.weight, layer.bias) for layer in model if isinstance(layer, ms.Linear)]
    return [
        tree_case("minishard mlp (Sequential of Layers)", model),
        tree_case("raw JAX [(w, b), ...]", raw),
        *equinox_cases(sizes),
        *nnx_cases(sizes),
    ]


def equinox_cases(sizes: Sequence[int]) -> list[FlattenCase]:
    try:
        import equinox as eqx
    except ImportError:
        print("(equinox is not installed: skipping its rows; `pip install equinox` to include them)")
        return []

    class EqxMLP(eqx.Module):
        """A hand-built Equinox module holding the same Linears as the minishard mlp."""

        layers: tuple[eqx.nn.Linear, ...]

    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    linears = tuple(eqx.nn.Linear(i, o, key=k) for k, i, o in zip(keys, sizes, sizes[1:]))
    mlp = eqx.nn.MLP(sizes[0], sizes[-1], sizes[1], len(sizes) - 2, activation=jax.nn.swish, key=keys[0])
    return [
        tree_case("equinox Module with the same Linears", EqxMLP(linears)),
        tree_case("equinox.nn.MLP (activations are leaves)", mlp),
    ]


def nnx_cases(sizes: Sequence[int]) -> list[FlattenCase]:
    try:
        from flax import nnx
    except ImportError:
        print("(flax is not installed: skipping the NNX rows)")
        return []
    layers: list[Any] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(nnx.swish)
        layers.append(nnx.Linear(n_in, n_out, rngs=nnx.Rngs(i)))
    model = nnx.Sequential(*layers)
    graphdef, state = nnx.split(model)
    return [
        FlattenCase(
            "flax nnx: nnx.split / nnx.merge",
            lambda: nnx.split(model),
            lambda: nnx.merge(graphdef, state),
            len(jax.tree_util.tree_leaves(state)),
        ),
        tree_case("flax nnx: jax.tree_util on nnx.state(model)", state),
        tree_case("flax nnx: jax.tree_util on the Module", model),
    ]


def batch_mean_us(fn: Callable[[], Any], number: int) -> float:
    """Mean microseconds per call over ``number`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number * 1e6


def interleaved_medians(fns: dict[str, Callable[[], Any]], samples: int, number: int) -> dict[str, float]:
    """Median over ``samples`` of each function's batch mean, the functions taking turns."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    with no_gc():
        for i in range(samples):
            for name in rotated(names, i):
                times[name].append(batch_mean_us(fns[name], number))
    return {name: statistics.median(t) for name, t in times.items()}


def bench_flatten(samples: int, number: int) -> None:
    sizes = CASES[1].sizes
    cases = flatten_cases(sizes)
    fns = {f"{c.name}/flatten": c.flatten for c in cases}
    fns |= {f"{c.name}/unflatten": c.unflatten for c in cases}
    for fn in fns.values():
        fn()  # warm up
    medians = interleaved_medians(fns, samples, number)
    print(f"\n== 2. Flatten cost of an MLP {list(sizes)} (median us per call; lower is better)")
    header = f"{'model':<46}{'leaves':>7}{'flatten':>10}{'unflatten':>11}"
    print(header)
    print("-" * len(header))
    for c in cases:
        flat, unflat = medians[f"{c.name}/flatten"], medians[f"{c.name}/unflatten"]
        print(f"{c.name:<46}{c.num_leaves:>7}{flat:>8.2f}us{unflat:>9.2f}us")


# --- 3. Sharded's per-call Python prelude ------------------------------------


def stubbed_sharded(fn: Callable[..., Any]) -> ShardedFunction:
    """A ShardedFunction whose cached "jit" does nothing: calling it times only the prelude.

    ``_build`` is what ``__call__`` runs on a cache miss; replacing it on this
    one instance makes the cache hold a no-op, so ``__call__`` still does its
    real flatten, key and lookup, but no jitted call follows.
    """
    mesh, rules = make_mesh_and_rules()
    probe = ms.Sharded(mesh, rules)(fn)
    probe._build = lambda args: _noop  # type: ignore[method-assign]
    return probe


def _noop(*args: Any) -> None:
    return None


def bench_prelude(samples: int, number: int, in_context: StepResult) -> None:
    """Time ``ShardedFunction.__call__`` minus the jitted call, and its three parts.

    ``in_context`` is section 1's result for the same arguments: its host-time
    difference is what the same work costs between real steps.
    """
    args = jax.device_put(make_args(CASES[0]))
    probe = stubbed_sharded(train_step)
    probe(*args)  # fill the cache with the no-op
    leaves, treedef = jax.tree_util.tree_flatten(args)
    batch_leaves = probe._batch_leaves[treedef]  # positions of the leaves outside Layers
    key = (treedef, *[getattr(leaves[i], "ndim", 0) == 0 for i in batch_leaves])
    cache = {key: _noop}
    # The three parts below mirror the first lines of ShardedFunction.__call__.
    fns = {
        "ShardedFunction.__call__ with a no-op jit (whole prelude)": lambda: probe(*args),
        "  jax.tree_util.tree_flatten(args)": lambda: jax.tree_util.tree_flatten(args),
        "  cache key: (treedef, *[ndim == 0 per batch leaf])": lambda: (
            treedef,
            *[getattr(leaves[i], "ndim", 0) == 0 for i in probe._batch_leaves.get(treedef, ())],
        ),
        "  dict lookup of a freshly built equal key": lambda: cache.get((treedef, *key[1:])),
        "  calling the no-op (Python call floor)": lambda: _noop(*args),
    }
    medians = interleaved_medians(fns, samples, number)
    print(f"\n== 3. Sharded per-call Python work before the jitted call ({len(leaves)} argument leaves)")
    for name, us in medians.items():
        print(f"{name:<58}{us:>8.2f}us")
    diff = in_context.host_us[SHARDED] - in_context.host_us[REFERENCE]
    print(
        f"Between real steps (section 1, {list(in_context.case.sizes)}, batch {in_context.case.batch}) "
        f"the host time differs by {diff:+.0f}us:\nthe same Python runs slower there, with cold caches "
        "and XLA's CPU threads competing for the cores."
    )


# --- main --------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per train-step case")
    parser.add_argument("--iters", type=int, default=200, help="paired steps per round")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    rounds, iters = (2, 30) if opts.quick else (opts.rounds, opts.iters)
    samples, number = (11, 200) if opts.quick else (41, 1000)
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{os.cpu_count()} CPU cores; {rounds} rounds x {iters} paired steps per case"
    )
    results = [bench_step(case, rounds, iters, warmup=max(iters // 4, 10)) for case in CASES]
    all_pass = print_step_results(results)
    bench_flatten(samples, number)
    bench_prelude(samples, number, in_context=results[0])
    verdict = "PASS" if all_pass else "FAIL"
    print(f"\nOverall: {verdict} (Sharded / jit step time <= {TARGET_RATIO} in every case)")
    return 1 if opts.strict and not all_pass else 0


if __name__ == "__main__":
    sys.exit(main())
