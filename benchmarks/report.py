"""Render a ``run.py --json`` result as markdown tables and a chart of per-call host overhead.

    python benchmarks/report.py runs/bench.json                      # tables to stdout
    python benchmarks/report.py runs/bench.json --chart docs/benchmarks_overhead.png \\
        --update docs/benchmarks.md                                  # refresh the docs page

``--update`` replaces what lies between ``<!-- bench:tables:start -->`` and
``<!-- bench:tables:end -->`` in the page and leaves the prose around it alone.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LOOPS = ("minishard", "handwritten")
START, END = "<!-- bench:tables:start -->", "<!-- bench:tables:end -->"


def stat(entry: dict[str, Any] | None, fmt: str = ".3f") -> str:
    """``1.042 [1.031, 1.050]``; an em dash when missing."""
    if not entry:
        return "—"
    lo, hi = entry["range"]
    return f"{entry['median']:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def targets_table(doc: dict[str, Any]) -> str:
    rows = []
    for row in doc.get("targets", []):
        measured = f"{row['median']} [{row['range'][0]}, {row['range'][1]}]"
        verdict = (
            ("met" + (", every round" if row["met_every_round"] else "")) if row["met"] else "**missed**"
        )
        rows.append([f"`{row['target']}`", row["limit"], measured, verdict])
    return table(["target", "limit", "measured: median [range over rounds]", "verdict"], rows)


def figures_table(doc: dict[str, Any]) -> str:
    rows = []
    for row in doc.get("figures", []):
        verdict = "met" if row["met"] else "**missed**"
        sign = "≥" if "/ minishard" in row["target"] and "host overhead" in row["target"] else "≤"
        rows.append([row["figure"], f"{row['median']} [{row['range'][0]}, {row['range'][1]}]",
                     f"{sign} {row['limit']}", verdict])  # fmt: skip
    return table(["figure", "measured: median [range over rounds]", "target", "verdict"], rows)


def phases_table(doc: dict[str, Any]) -> str:
    ph = doc.get("phases")
    if not ph:
        return "(not run)"
    rows = [
        [f"`{name}`", stat(ph["host_diff_us"][name], ".1f"), stat(ratio)]
        for name, ratio in ph["host_ratio"].items()
    ]
    calls = table(["contender", "host µs per call over raw", "host ratio"], rows)
    parts = [[name, stat(entry, ".1f")] for name, entry in ph["breakdown_us"].items()]
    parts += [[f"alone: {name}", f"{us:.2f}"] for name, us in ph["phase_us"].items()]
    return calls + "\n\n" + table(["where the µs go (paired differences; phases timed alone)", "µs"], parts)


def steps_table(doc: dict[str, Any]) -> str:
    names = list(doc.get("host_ratio", {}))
    rows = []
    for name in names:
        rows.append([
            f"`{name}`",
            stat(doc["host_overhead_us"].get(name), ".1f"),
            stat(doc["host_ratio"].get(name)),
            stat(doc["step_ratio"]["micro"].get(name)),
            stat(doc["pipelined_ratio"]["micro"].get(name)),
            stat(doc["step_ratio"]["seed"].get(name)),
            stat(doc["pipelined_ratio"]["seed"].get(name)),
        ])  # fmt: skip
    header = [
        "contender", "host µs over raw", "host ratio", "blocked ratio, micro", "pipelined ratio, micro",
        "blocked ratio, seed", "pipelined ratio, seed",
    ]  # fmt: skip
    return table(header, rows)


def flatten_table(doc: dict[str, Any]) -> str:
    flat = doc.get("flatten")
    if not flat:
        return "(not run)"
    rows = [
        [
            f"`{name}`",
            flat["leaves"][name],
            f"{flat['diff_us_per_round_trip'][name]:+.2f}",
            stat(ratio, ".2f"),
        ]
        for name, ratio in flat["ratio"].items()
    ]
    return table(["model object", "leaves", "µs per round trip over raw", "ratio to raw"], rows)


def compile_table(doc: dict[str, Any]) -> str:
    if "compile" not in doc:
        return "(not run)"
    c = doc["compile"]
    rows = [
        [
            f"`{name}`",
            stat(c["lower_ratio"][name]),
            stat(c["compile_ratio"][name]),
            stat(doc["compile_ratio"][name]),
            stat(c["wall_ratio"][name]),
        ]
        for name in doc["compile_ratio"]
    ]
    header = ["contender", "lower", "compile", "lower + compile (the target)", "wall time (noisier)"]
    return table(header, rows)


def parallel_table(doc: dict[str, Any]) -> str:
    par = doc.get("parallel")
    if not par:
        return "(not run)"
    rows = []
    for style, r in par["styles"].items():
        c = r["collectives"]
        kinds = (
            "; ".join(
                f"{kind} x{k['count']} {k['bytes']:,} B over {', '.join('+'.join(a) for a in k['over'])}"
                for kind, k in c["kinds"].items()
            )
            or "none"
        )
        per_device = r["param_bytes_per_device"]
        rows.append([
            style,
            ", ".join(f"{k}={v}" for k, v in r["mesh"].items()),
            " ".join(f"`{s}`" for s in r["param_specs"]),
            stat(r["sharded_vs_handwritten"]),
            stat(r["aa_control"]),
            kinds,
            f"{c['bytes']:,}",
            f"{c['analytic_bytes']:,}",
            f"{per_device['max']:,} of {per_device['unsharded']:,}",
        ])  # fmt: skip
    header = [
        "style", "mesh", "W1 b1 W2 b2 specs", "Sharded / hand-written", "A/A", "collectives (per device)",
        "bytes", "analytic minimum", "param bytes per device",
    ]  # fmt: skip
    formulas = "\n".join(
        f"* **{style}**: {r['collectives']['formula']}" for style, r in par["styles"].items()
    )
    return table(header, rows) + "\n\nAnalytic minimum (B = batch):\n\n" + formulas


def epoch_table(doc: dict[str, Any]) -> str:
    e = doc.get("epoch")
    if not e or "skipped" in e:
        return f"(not run: {e.get('skipped') if e else 'section not selected'})"
    pipe = e["input_pipeline"]
    rows = [
        ["epoch time, minishard / hand-written", stat(doc.get("epoch_ratio"))],
        ["epoch time difference, s", stat(e["diff_s"])],
        ["of which the data path (`to_global` vs `device_put`, 2 fields), s", stat(e["data_path_diff_s"])],
        ["steps per epoch (examples)", f"{e['steps_per_epoch']} ({e['examples']:,})"],
        ["mean loss, minishard / hand-written", " / ".join(str(e["mean_loss"].get(n)) for n in LOOPS)],
        ["input pipeline, images/s (gather + `to_global`)", stat(pipe["images_per_s"], ",.0f")],
        ["images/s the minishard steps consume (data excluded)", stat(pipe["step_images_per_s"], ",.0f")],
        ["share of the epoch spent on data", stat(pipe["data_fraction_of_epoch"])],
        ["data is the limit", pipe["data_is_limit"]],
    ]  # fmt: skip
    if "fit" in e:
        fit = e["fit"]
        rows.append(
            ["`fit` gives the loop's loss", f"{fit['same_loss']} ({fit['loss']} vs {fit['same_loop_loss']})"]
        )
    return table(["quantity", "median [range]"], rows)


def gpt_table(doc: dict[str, Any]) -> str:
    g = doc.get("gpt_step")
    if not g:
        return "(not run: section not selected)"
    rows = [
        [name, stat(g["ratio"][name]), g["step_ms"][name], f"{g['tokens_per_s'][name]:,}"]
        for name in g["ratio"]
    ]
    sizes = ", ".join(f"{k} {v}" for k, v in g["sizes"].items())
    return f"GPT {sizes}; batch {g['batch']}; mesh {g['mesh']}; {g['parameters']:,} parameters.\n\n" + table(
        ["contender", "step ratio to hand-written, median [range]", "step ms", "tokens/s"], rows
    )


def roofline_table(doc: dict[str, Any]) -> str:
    r = doc.get("roofline")
    if not r:
        return "(not run)"
    rows = [["1024² float32 matmul, GFLOP/s", stat(r["matmul_gflops"], ".1f")]]
    rows += [[f"seed step `{n}`, GEMM GFLOP/s", stat(s, ".1f")] for n, s in r["step_gflops"].items()]
    rows += [[f"seed step `{n}` / matmul", stat(s)] for n, s in r["fraction"].items()]
    note = f"GEMM FLOPs per seed step: {r['step_gemm_flops']:,} (forward + backward, no input gradient)."
    return table(["quantity", "median [range]"], rows) + "\n\n" + note


def variants_table(doc: dict[str, Any]) -> str:
    v = doc.get("variants")
    if not v:
        return "(not run)"
    rows = [
        [f"`{name}`", stat(v["host_diff_us"][name], ".1f"), stat(ratio), stat(v["step_ratio"][name]),
         v["round_trip_us"].get(name, "")]
        for name, ratio in v["host_ratio"].items()
    ]  # fmt: skip
    header = ["variant", "host µs over raw", "host ratio", "blocked step ratio", "model round trip alone, µs"]
    return table(header, rows)


def render(doc: dict[str, Any], chart: str | None = None) -> str:
    meta = doc["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in doc["versions"].items() if v)
    parts = [
        f"Run: `{doc['mode']}` mode, {doc['date']}, {doc['seconds']} s. Machine: {meta['cpu']}, "
        f"{meta['cores']} cores, {doc['devices']}; {versions}. Load average "
        f"{', '.join(f'{x:.2f}' for x in doc['loadavg_start'])} at the start, "
        f"{', '.join(f'{x:.2f}' for x in doc['loadavg_end'])} at the end.",
        "### The figures of issue 28\n\n" + figures_table(doc),
        "### Targets\n\n" + targets_table(doc),
        "### 1. Per-step cost (paired ratios to `raw`; host µs: paired difference per call)\n\n"
        + steps_table(doc),
    ]
    if chart:
        parts.append(f"![Per-call host overhead over raw jax.jit]({chart})")
    parts += [
        "### 2. Flatten + unflatten of each library's model object (seed size)\n\n" + flatten_table(doc),
        "### 3. First-call compile: CPU-time ratios to `raw`, a fresh process per sample\n\n"
        + compile_table(doc),
        "### 4. `Sharded` vs a hand-written `jax.jit`, 8 simulated devices\n\n" + parallel_table(doc),
        "### 5. MNIST epoch and input pipeline\n\n" + epoch_table(doc),
        "### 6. Physical reference\n\n" + roofline_table(doc),
        "### 7. Where the remaining per-call cost sits: minishard against bounds "
        "(dispatch-bound step, paired with `raw`)\n\n" + variants_table(doc),
        "### 8. The GPT's AdamW step under `Sharded` dp vs a hand-written plain-JAX step\n\n"
        + gpt_table(doc),
        "### 9. One `Sharded` call on 8 devices against raw `jax.jit`, phase by phase "
        "(dispatch-bound step, batch 8)\n\n" + phases_table(doc),
    ]
    return "\n\n".join(parts) + "\n"


def draw_chart(doc: dict[str, Any], path: str) -> None:
    """Bars of host µs per call over raw's, with the range across rounds as error bars (log scale)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = {k: v for k, v in doc["host_overhead_us"].items() if k not in ("raw", "raw_copy")}
    names = sorted(entries, key=lambda n: entries[n]["median"])
    medians = [max(entries[n]["median"], 0.1) for n in names]
    lower = [max(m - max(entries[n]["range"][0], 0.1), 0.0) for m, n in zip(medians, names)]
    upper = [max(entries[n]["range"][1] - m, 0.0) for m, n in zip(medians, names)]  # medians clamped at 0.1
    colors = ["tab:orange" if n.startswith("minishard") else "tab:gray" for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.barh(names, medians, xerr=[lower, upper], color=colors, capsize=3)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlim(min(medians) / 2, max(m + u for m, u in zip(medians, upper)) * 2)
    ax.set_xlabel("host µs per call over raw jax.jit (log scale; bars: range over rounds)")
    ax.set_title(f"Per-call host overhead, dispatch-bound MLP step ({doc['mode']} run)")
    for y, (m, u) in enumerate(zip(medians, upper)):
        ax.text((m + u) * 1.12, y, f"{m:.0f} µs", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_page(page: str, markdown: str) -> None:
    text = Path(page).read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{page} has no {START} ... {END} block to replace")
    Path(page).write_text(pattern.sub(lambda _: f"{START}\n\n{markdown}\n{END}", text))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("json_path")
    parser.add_argument("--chart", help="write the host-overhead chart (PNG) here")
    parser.add_argument("--update", metavar="PAGE", help="replace the tables block of this markdown page")
    opts = parser.parse_args(argv)
    doc = json.loads(Path(opts.json_path).read_text())
    chart_link = None
    if opts.chart:
        draw_chart(doc, opts.chart)
        chart_link = Path(opts.chart).name if opts.update else opts.chart
    markdown = render(doc, chart_link)
    if opts.update:
        update_page(opts.update, markdown)
    else:
        sys.stdout.write(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
