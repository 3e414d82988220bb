"""Every style, the same curve: one GPT, one seed, one data order, trained under each style.

picotron's sanity check, and Levanter's promise: how the work is spread over
devices changes where numbers are computed, never which numbers. The GPT of
nanoGPT's CPU shape trains for ``--steps`` AdamW steps (float32) under dp, tp,
2d, fsdp, ZeRO-3 and dp+pp (its blocks stacked and pipelined, 4 microbatches)
on 8 simulated devices (tp on 4: its 4 heads split at most 4 ways), from the
same initial parameters and on the same batches. Printed: the largest
|loss - dp's loss| over the steps, per style (expected <= 1e-4: float32 sums
taken in another order). ``--plot`` draws all
the curves on one picture (docs/gpt.md).

    nice python benchmarks/gpt_styles.py --steps 200 --plot docs/gpt_styles.png
"""

from __future__ import annotations

from simulated import FLAG  # noqa: F401  # first: 8 simulated devices before JAX starts

# isort: split

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

import minishard as ms
from minishard.composition import ComposedPipeline
from minishard.models import gpt
from minishard.optim import AdamW, warmup_cosine_decay
from minishard.run.next_token import next_token_loss
from minishard.run.steps import make_train_step
from minishard.run.text_data import tiny_shakespeare
from minishard.styles import mesh_rules
from minishard.zero import zero_train_step

STYLES = ("dp", "tp", "2d", "fsdp", "zero", "dp+pp")


def losses_under(style: str, steps: int, batch_size: int, seed: int = 0) -> list[float]:
    """The training losses of ``steps`` steps of the GPT under ``style``."""
    text = tiny_shakespeare("train", 64, batch_size, seed=seed)
    optimizer = AdamW(warmup_cosine_decay(1e-3, min(100, steps // 2), steps, end_value=1e-4))
    model = gpt.GPT(len(text.vocabulary), key=jax.random.key(seed))
    if style == "zero":  # ZeRO-3: parameters, gradients and both moments split 8 ways
        step = zero_train_step(optimizer, ms.make_mesh({"data": 8}), level=3, loss=next_token_loss)
        model = step.shard(model)
        state = step.init(model)
    else:  # tp: 4 heads split at most 4 ways, so 4 devices; every other style on all 8
        shape, rules = mesh_rules(style, 4 if style == "tp" else 8)
        mesh = ms.make_mesh(shape, devices=jax.devices()[: 4 if style == "tp" else 8])
        if style == "dp+pp":  # data 2 x stage 4: a block per stage, 4 microbatches
            model = gpt.as_stacked(model).replace(pipeline=ComposedPipeline(mesh, 4, data_axis="data"))
        step = ms.Sharded(mesh, rules, donate_argnums=(0, 1))(make_train_step(optimizer, next_token_loss))
        model, state = ms.shard(model, mesh, rules), ms.shard(optimizer.init(model), mesh, rules)
    losses = []
    for i in range(steps):  # wait for every step: simulated devices share the host's cores
        model, state, loss, _ = jax.block_until_ready(step(model, state, text.batch(i)))
        losses.append(float(loss))
    return losses


def draw(curves: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    for i, (style, losses) in enumerate(curves.items()):
        color, wide = f"C{i}", style == "dp"
        ax.plot(losses, label=style, color=color, linewidth=3 if wide else 1, alpha=0.4 if wide else 0.9)
        if style != "dp":  # the largest gap so far: where the curves part, if they ever do
            gaps = [abs(a - b) for a, b in zip(losses, curves["dp"])]
            diff.plot([max(gaps[: k + 1]) for k in range(len(gaps))], label=style, color=color)
    ax.set_ylabel("training loss (nats per character)")
    ax.legend()
    diff.set_yscale("symlog", linthresh=1e-7)
    diff.set_ylabel("largest |loss - dp's| so far")
    diff.set_xlabel("step")
    ax.set_title("One GPT, one seed, six ways to spread it over the devices")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--styles", default=",".join(STYLES))
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument("--json", metavar="PATH")
    opts = parser.parse_args(argv)
    started, load = time.perf_counter(), os.getloadavg()
    curves: dict[str, Any] = {}
    for style in opts.styles.split(","):
        t0 = time.perf_counter()
        curves[style] = losses_under(style, opts.steps, opts.batch_size)
        seconds = time.perf_counter() - t0
        print(f"{style:<6} final loss {curves[style][-1]:.4f}  ({seconds:.0f} s)", flush=True)
    print(f"\nlargest |loss - dp's loss| over {opts.steps} steps (float32):")
    gaps = {style: max(abs(a - b) for a, b in zip(losses, curves["dp"])) for style, losses in curves.items()}
    for style, gap in gaps.items():
        if style != "dp":
            print(f"  {style:<6} {gap:.2e}")
    print(f"wall {time.perf_counter() - started:.0f} s; load average {load} -> {os.getloadavg()}")
    if opts.plot:
        draw(curves, opts.plot)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"curves": curves, "largest_gap": gaps, "steps": opts.steps}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
