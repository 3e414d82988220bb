"""``make bench``: what does minishard cost, next to raw JAX, Flax and Equinox, on this machine?

Nine sections, each a module of this folder (``python benchmarks/run.py --help``):

1. ``steps``: per-step cost of the same MLP step in every library, blocked,
   pipelined and host-only, dispatch-bound ([784, 64, 10], batch 1) and seed
   size ([784, 512, 10], batch 128);
2. ``steps``: ``tree_flatten`` + ``tree_unflatten`` of each library's model;
3. ``compile_time``: first-call lower and compile, one fresh process per sample;
4. ``parallel``: ``Sharded`` vs a hand-written ``jax.jit`` on 8 simulated
   devices (data, Megatron, 2-D, FSDP), with collectives and their analytic minimum;
5. ``epoch``: an MNIST epoch vs a hand-written plain-JAX loop, and the input pipeline;
6. ``roofline``: GFLOP/s of a 1024² matmul, and the seed step's fraction of it;
7. ``variants``: where minishard's remaining per-call cost sits, against bounds it cannot adopt;
8. ``gpt_step``: the GPT's AdamW step under ``Sharded`` dp vs a hand-written plain-JAX one, 8 devices;
9. ``phases``: one ``Sharded`` call on 8 devices against raw ``jax.jit``, phase by phase.

Every comparison uses the method of ``harness.py``: interleaved contenders
in rotating order, paired ratios, medians over rounds with their range, an A/A
control, GC off in timed loops. Absolute times are never quoted alone.

    python benchmarks/run.py                         # full: 8-10 minutes on 2 shared cores
    python benchmarks/run.py --quick --json out.json # reduced: 1.5-3.5 minutes, as the load goes
    python benchmarks/report.py out.json             # markdown tables + chart for docs/
"""

from __future__ import annotations

from simulated import FLAG  # first: 8 simulated devices before JAX starts its backend

# isort: split

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import jax
from contenders import CONTROL, FACTORIES, FLOOR, REFERENCE, Problem, available

SECTIONS = ("steps", "flatten", "compile", "parallel", "epoch", "roofline", "variants", "gpt", "phases")


@dataclass(frozen=True)
class Settings:
    """Sizes and repetitions of one run mode."""

    micro: tuple[tuple[int, ...], int] = ((784, 64, 10), 1)  # dispatch-bound
    seed: tuple[tuple[int, ...], int] = ((784, 512, 10), 128)
    parallel_batch: int = 256
    rounds: int = 7
    micro_iters: int = 200
    seed_iters: int = 100
    warmup: int = 30
    burst: int = 10
    micro_pipe_iters: int = 30
    seed_pipe_iters: int = 10
    flatten_iters: int = 60
    flatten_number: int = 50
    compile_rounds: int = 4
    compile_contenders: tuple[str, ...] = tuple(name for name in FACTORIES if name not in (CONTROL, FLOOR))
    parallel_rounds: int = 5
    parallel_iters: int = 40
    epoch_examples: int | None = None  # None: the whole epoch
    epoch_rounds: int = 4
    roofline_rounds: int = 5
    roofline_iters: int = 20
    gpt_shape: tuple[int, int, int, int] = (128, 4, 4, 64)  # width, depth, heads, context: nanoGPT's CPU one
    gpt_batch: int = 16
    gpt_rounds: int = 5
    gpt_iters: int = 20
    gpt_warmup: int = 3
    phases_batch: int = 8  # one example per device: the dispatch-bound step on 8 devices
    phases_rounds: int = 7
    phases_iters: int = 300  # a step is ~0.3 ms of host time: many iterations are cheap here


FULL = Settings()
QUICK = Settings(
    rounds=3, micro_iters=60, seed_iters=30, warmup=10, micro_pipe_iters=10, seed_pipe_iters=4,
    flatten_iters=30, compile_rounds=2, compile_contenders=("raw", "minishard_jit", "minishard_sharded"),
    parallel_rounds=5, parallel_iters=20, phases_rounds=5, phases_iters=200,
    epoch_examples=60 * 128, epoch_rounds=3, roofline_rounds=3, roofline_iters=6, gpt_rounds=3, gpt_iters=8,
)  # fmt: skip
TINY = Settings(  # the smoke test: every code path, tiny sizes, seconds
    micro=((32, 16, 10), 2), seed=((32, 16, 10), 8), parallel_batch=16,
    rounds=2, micro_iters=5, seed_iters=5, warmup=2, burst=2, micro_pipe_iters=2, seed_pipe_iters=2,
    flatten_iters=3, flatten_number=5, compile_rounds=1, compile_contenders=("raw", "minishard_sharded"),
    parallel_rounds=2, parallel_iters=2, epoch_examples=2 * 128, epoch_rounds=1,
    roofline_rounds=2, roofline_iters=2,
    gpt_shape=(32, 1, 4, 16), gpt_batch=8, gpt_rounds=2, gpt_iters=2, gpt_warmup=1,
    phases_rounds=2, phases_iters=5,
)  # fmt: skip

TARGETS = {
    "phases.host_diff_us.sharded": 10.0,  # µs over raw jax.jit, 8 devices
    "host_ratio.minishard_jit": 1.1,
    "host_ratio.minishard_sharded": 1.2,
    "step_ratio.micro.minishard_sharded": 1.08,
    "step_ratio.seed.minishard_jit": 1.02,
    "step_ratio.seed.minishard_sharded": 1.02,
    "sharded_vs_handwritten.<style>": 1.02,
    "compile_ratio.minishard_jit": 1.05,
    "compile_ratio.minishard_sharded": 1.05,
    "epoch_ratio": 1.03,
    "gpt_step_ratio": 1.05,
}


FIGURES = {  # issue 28's table: each figure, and the target row that measures it
    "`Sharded` host overhead per call over raw `jax.jit`, 8 devices, µs": "phases.host_diff_us.sharded",
    "eqx.filter_jit's host overhead / `Sharded`'s": "host overhead eqx_filter_jit / minishard_sharded",
    "nnx.jit's host overhead / `Sharded`'s": "host overhead nnx_jit / minishard_sharded",
    "`Sharded` host time / raw `jax.jit`, 1 device": "host_ratio.minishard_sharded",
    "plain `jax.jit` of a minishard model / raw, 1 device": "host_ratio.minishard_jit",
    "seed step (784-512-10, batch 128) `Sharded` / raw": "step_ratio.seed.minishard_sharded",
    "`Sharded` / the hand-written data-parallel step": "sharded_vs_handwritten.data_parallel",
}


# --- machine ------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    versions = {}
    for package in ("jax", "jaxlib", "flax", "equinox", "optax", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "machine": {
            "cpu": cpu,
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform} (simulated: {FLAG})",
        "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "loadavg_start": list(os.getloadavg()),
    }


# --- the run ------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, flush=True)


def run_sections(settings: Settings, sections: Sequence[str]) -> dict[str, Any]:
    """Run the chosen sections; the result is the JSON document (without the targets)."""
    out: dict[str, Any] = machine()
    out["settings"] = asdict(settings)
    timings: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        log(f"== {name} ...")
        t0 = time.perf_counter()
        result = fn()
        timings[name] = round(time.perf_counter() - t0, 1)
        log(f"   {name}: {timings[name]} s")
        return result

    names = list(FACTORIES)
    seed_contenders = None
    if "steps" in sections or "flatten" in sections:
        import steps

        step_results = {}
        for size in ("micro", "seed"):
            sizes, batch = getattr(settings, size)
            iters = settings.micro_iters if size == "micro" else settings.seed_iters
            pipe = settings.micro_pipe_iters if size == "micro" else settings.seed_pipe_iters
            problem = Problem.make(sizes, batch)
            step_results[size] = timed(
                f"1. steps {size} {list(sizes)} batch {batch}",
                lambda problem=problem, iters=iters, pipe=pipe: steps.bench_steps(
                    problem, names, settings.rounds, iters, settings.warmup, settings.burst, pipe
                ),
            )
        seed_contenders = step_results["seed"]["contenders"]
        micro = step_results["micro"]["comparisons"]
        out["host_overhead_us"] = micro["host"].as_json("diff_us")
        out["host_ratio"] = micro["host"].as_json("ratio")
        out["step_ratio"] = {
            size: r["comparisons"]["blocked"].as_json("ratio") for size, r in step_results.items()
        }
        out["pipelined_ratio"] = {
            size: r["comparisons"]["pipelined"].as_json("ratio") for size, r in step_results.items()
        }
        out["steps"] = {
            size: {
                "sizes": list(getattr(settings, size)[0]),
                "batch": getattr(settings, size)[1],
                "modes": steps.comparisons_json(r["comparisons"]),
                "losses_first_two_steps": r["losses_first_two_steps"],
                "skipped": r["skipped"],
            }
            for size, r in step_results.items()
        }
        if "flatten" in sections:
            out["flatten"] = timed(
                "2. flatten",
                lambda: steps.bench_flatten(
                    seed_contenders, settings.rounds, settings.flatten_iters, settings.flatten_number
                ),
            )
    if "compile" in sections:
        import compile_time

        sizes, batch = settings.seed
        compile_names, _ = available(settings.compile_contenders)
        result = timed(
            "3. compile",
            lambda: compile_time.bench_compile(
                compile_names, REFERENCE, sizes, batch, settings.compile_rounds
            ),
        )
        out["compile_ratio"] = result.pop("ratio")
        out["compile"] = result
    if "parallel" in sections:
        import parallel

        sizes, _ = settings.seed
        result = timed(
            "4. parallel",
            lambda: parallel.bench_parallel(
                Problem.make(sizes, settings.parallel_batch),
                settings.parallel_rounds,
                settings.parallel_iters,
                max(settings.parallel_iters // 4, 2),
            ),
        )
        out["sharded_vs_handwritten"] = {s: r["sharded_vs_handwritten"] for s, r in result["styles"].items()}
        out["collectives"] = {s: r["collectives"] for s, r in result["styles"].items()}
        out["parallel"] = result
    if "epoch" in sections:
        import epoch

        try:
            result = timed(
                "5. epoch", lambda: epoch.bench_epoch(settings.epoch_examples, settings.epoch_rounds)
            )
        except Exception as error:  # no prepared MNIST: say so, keep the rest of the report
            if type(error).__name__ not in ("DataError", "ImportError"):
                raise
            log(f"   5. epoch skipped: {error}")
            result = {"skipped": str(error)}
        if "epoch_ratio" in result:
            out["epoch_ratio"] = result.pop("epoch_ratio")
        out["epoch"] = result
    if "roofline" in sections:
        import roofline

        sizes, batch = settings.seed
        result = timed(
            "6. roofline",
            lambda: roofline.bench_roofline(
                Problem.make(sizes, batch),
                [REFERENCE, "minishard_sharded"],
                settings.roofline_rounds,
                settings.roofline_iters,
            ),
        )
        out["matmul_fraction"] = result["fraction"]
        out["roofline"] = result
    if "variants" in sections:
        import variants

        sizes, batch = settings.micro
        out["variants"] = timed(
            "7. variants",
            lambda: variants.bench_variants(
                Problem.make(sizes, batch), settings.rounds, settings.micro_iters, settings.warmup,
                settings.flatten_number,
            ),
        )  # fmt: skip
    if "gpt" in sections:
        import gpt_step

        width, depth, heads, context = settings.gpt_shape
        sizes = dict(vocab=65, context=context, width=width, depth=depth, heads=heads)
        result = timed(
            f"8. gpt step {sizes} batch {settings.gpt_batch}",
            lambda: gpt_step.bench_gpt(
                sizes, settings.gpt_batch, settings.gpt_rounds, settings.gpt_iters, settings.gpt_warmup
            ),
        )
        out["gpt_step_ratio"] = result["ratio"]["minishard"]
        out["gpt_step"] = result
    if "phases" in sections:
        import phases

        sizes, _ = settings.micro
        out["phases"] = timed(
            f"9. phases {list(sizes)} batch {settings.phases_batch}, 8 devices",
            lambda: phases.bench_phases(
                Problem.make(sizes, settings.phases_batch), settings.phases_rounds, settings.phases_iters,
                settings.warmup, settings.flatten_number,
            ),
        )  # fmt: skip
    out["seconds_per_section"] = timings
    out["loadavg_end"] = list(os.getloadavg())
    return out


# --- targets ----------------------------------------------------------------------------


def lookup(doc: dict[str, Any], path: str) -> Any:
    node: Any = doc
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def check_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target: the measured median and range, and whether the median (and the range) meets it."""
    rows: list[dict[str, Any]] = []

    def add(name: str, stat: Any, limit: float, higher_is_better: bool = False) -> None:
        if stat is None:
            return
        lo, hi = stat["range"]
        ok = stat["median"] >= limit if higher_is_better else stat["median"] <= limit
        robust = lo >= limit if higher_is_better else hi <= limit
        rows.append({"target": name, "limit": limit, "median": stat["median"], "range": [lo, hi], "met": ok,
                     "met_every_round": robust})  # fmt: skip

    for path, limit in TARGETS.items():
        if "<style>" in path:
            for style, stat in (doc.get("sharded_vs_handwritten") or {}).items():
                add(path.replace("<style>", style), stat, limit)
        else:
            add(path, lookup(doc, path), limit)
    for style, c in (doc.get("collectives") or {}).items():
        rows.append({
            "target": f"collectives.{style}: bytes == analytic minimum",
            "limit": c["analytic_bytes"], "median": c["bytes"], "range": [c["bytes"], c["bytes"]],
            "met": c["bytes"] == c["analytic_bytes"], "met_every_round": c["bytes"] == c["analytic_bytes"],
        })  # fmt: skip
        if style != "fsdp":
            gathered = c["all_gather_of_weights"]
            rows.append({
                "target": f"collectives.{style}: no all-gather", "limit": 0, "median": int(gathered),
                "range": [int(gathered)] * 2, "met": not gathered, "met_every_round": not gathered,
            })  # fmt: skip
    overhead = doc.get("host_overhead_us") or {}
    for ours in ("minishard_jit", "minishard_sharded"):
        for theirs in ("nnx_jit", "eqx_filter_jit"):
            if ours in overhead and theirs in overhead and overhead[ours]["median"] > 0:
                factor = overhead[theirs]["median"] / overhead[ours]["median"]
                lo = overhead[theirs]["range"][0] / overhead[ours]["range"][1]
                hi = overhead[theirs]["range"][1] / max(overhead[ours]["range"][0], 1e-9)
                stat = {"median": round(factor, 2), "range": [round(lo, 2), round(hi, 2)]}
                add(f"host overhead {theirs} / {ours}", stat, 20.0, higher_is_better=True)
    return rows


def figures(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's table: each figure with its target row (those measured in this run)."""
    rows = {row["target"]: row for row in doc["targets"]}
    return [{"figure": figure, **rows[name]} for figure, name in FIGURES.items() if name in rows]


def print_summary(doc: dict[str, Any]) -> None:
    def table(title: str, entries: dict[str, Any] | None, fmt: str = ".3f") -> None:
        if not entries:
            return
        log(f"\n{title}")
        for name, stat in entries.items():
            log(
                f"  {name:<24}{stat['median']:>10{fmt}}  [{stat['range'][0]:{fmt}}, {stat['range'][1]:{fmt}}]"
            )

    table("host time per call, ratio to raw (dispatch-bound)", doc.get("host_ratio"))
    table("host time per call minus raw's, µs (dispatch-bound)", doc.get("host_overhead_us"), ".1f")
    for size, entries in (doc.get("step_ratio") or {}).items():
        table(f"blocked step ratio to raw, {size}", entries)
    for size, entries in (doc.get("pipelined_ratio") or {}).items():
        table(f"pipelined step ratio to raw, {size} (single-device programs only)", entries)
    table("compile (lower + compile) CPU-time ratio to raw, a fresh process each", doc.get("compile_ratio"))
    table("Sharded / hand-written jit, 8 devices", doc.get("sharded_vs_handwritten"))
    if doc.get("collectives"):
        log("\ncollective bytes per step (per device) vs analytic minimum")
        for style, c in doc["collectives"].items():
            kinds = ", ".join(f"{k} x{v['count']} {v['bytes']} B" for k, v in c["kinds"].items())
            log(f"  {style:<14}{c['bytes']:>10} B  (minimum {c['analytic_bytes']} B)  {kinds}")
    if doc.get("epoch_ratio"):
        table("epoch time, minishard / hand-written", {"epoch_ratio": doc["epoch_ratio"]})
    if doc.get("matmul_fraction"):
        table("seed step GFLOP/s as a fraction of a 1024² matmul's", doc["matmul_fraction"])
    if doc.get("variants"):
        table("variants: host time ratio to raw (dispatch-bound)", doc["variants"]["host_ratio"])
    if doc.get("gpt_step"):
        table("GPT AdamW step under dp, ratio to the hand-written jit, 8 devices", doc["gpt_step"]["ratio"])
        log(f"  tokens per second: {doc['gpt_step']['tokens_per_s']}")
    if doc.get("phases"):
        table("Sharded on 8 devices: host µs per call over raw jax.jit", doc["phases"]["host_diff_us"], ".1f")
        table("  of which (paired differences, µs)", doc["phases"]["breakdown_us"], ".1f")
        log(f"  phases alone, µs per call: {doc['phases']['phase_us']}")
    log("\ntargets (met: by the median; every round: by the whole range)")
    for row in doc["targets"]:
        verdict = "MET" if row["met"] else "MISSED"
        log(f"  {verdict:<7}{'(every round)' if row['met_every_round'] else '':<14}{row['target']:<52}"
            f"{row['median']} [{row['range'][0]}, {row['range'][1]}] (limit {row['limit']})")  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a reduced run (about 2 minutes)")
    mode.add_argument("--tiny", action="store_true", help="tiny sizes, every code path (the smoke test)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    settings = TINY if opts.tiny else QUICK if opts.quick else FULL
    sections = [s for s in opts.sections.split(",") if s]
    if unknown := sorted(set(sections) - set(SECTIONS)):
        raise SystemExit(f"unknown sections {unknown}; choose from {SECTIONS}")
    mode = "tiny" if opts.tiny else "quick" if opts.quick else "full"
    log(
        f"minishard benchmarks ({mode}): jax {jax.__version__}, "
        f"{jax.device_count()} devices, {os.cpu_count()} cores"
    )
    started = time.perf_counter()
    doc = run_sections(settings, sections)
    doc["mode"] = mode
    doc["seconds"] = round(time.perf_counter() - started, 1)
    doc["targets"] = check_targets(doc)
    doc["figures"] = figures(doc)
    print_summary(doc)
    log(f"\ntotal {doc['seconds']} s; load average {doc['loadavg_start']} -> {doc['loadavg_end']}")
    if opts.json:
        os.makedirs(os.path.dirname(os.path.abspath(opts.json)), exist_ok=True)
        with open(opts.json, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"wrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
