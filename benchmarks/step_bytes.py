"""Issue 61 §3, ahead of time: what XLA:TPU makes of minishard's GPT step and of the plain one.

Both steps of ``chip_speed.py`` (minishard's ``train`` step in bf16 with dense attention, and
``chip_speed.plain_step``'s hand-written one, cast to bf16 as ``jmp`` would), lowered for one v5e
(``v5e:1x1``) and compiled here by libtpu: no chip needed (docs/tpu.md). For each, XLA:TPU's

* FLOPs and bytes accessed (``cost_analysis``: its estimate of the HBM traffic, the step's
  roofline when the matrix unit is not the limit);
* temporaries and arguments (``memory_analysis``): what the step keeps for its backward pass;
* ``--hlo DIR``: the optimized programs' text, to put side by side.

    python benchmarks/step_bytes.py --json step_bytes.json              # nanoGPT's shape
    python benchmarks/step_bytes.py --shapes "12x768 ctx1024" --hlo hlo

Each contender compiles in a fresh process (XLA's default flags, no simulated devices).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from recipe_compile import in_fresh_process  # this directory's

SHAPES = {
    "6x384 ctx256": ({"depth": 6, "width": 384, "heads": 6, "context": 256}, 64),
    "12x768 ctx1024": ({"depth": 12, "width": 768, "heads": 12, "context": 1024}, 16),
}
CONTENDERS = ("minishard", "plain")


def measure(contender: str, shape_name: str, hlo: str | None = None) -> dict[str, Any]:
    """In this process: one contender compiled for ``v5e:1x1``, its cost and memory."""
    import jax
    import jax.numpy as jnp
    from chip_speed import VOCAB, flags_of, plain_step
    from gpt_step import params_of

    from minishard.costs import Memory
    from minishard.models import gpt
    from minishard.precision import PRECISIONS
    from minishard.run.cli import parse_args
    from minishard.run.cli.models import MODELS
    from minishard.run.cli.styles import style_of
    from minishard.run.steps import make_train_step
    from minishard.run.topology import tpu_devices
    from minishard.sharding import Sharded, make_mesh

    shape, batch = SHAPES[shape_name]
    devices = tpu_devices("v5e:1x1")
    if contender == "minishard":  # chip.compiled_step's step, lowered on the topology's device
        args = parse_args(["train", "--devices", "1", "--precision", "bf16", *flags_of(shape, batch)])
        entry, style = MODELS["gpt"], style_of(args.parallel)
        model = jax.eval_shape(lambda: style.build(entry, args, jax.random.key(0)))
        optimizer = entry.compiled_optimizer(args)
        step = make_train_step(optimizer, entry.task.loss, 1, PRECISIONS["bf16"])
        mesh = make_mesh(style.mesh(1), devices=devices)
        sharded = Sharded(mesh, style.rules({}), donate_argnums=(0, 1))(step)
        state, data = jax.eval_shape(optimizer.init, model), entry.example(args, batch)
        compiled = sharded.lower(model, state, data).compile()
    else:  # chip_speed.plain_step, its arguments placed on the topology's device
        on_chip = jax.sharding.SingleDeviceSharding(devices[0])
        params = jax.eval_shape(lambda: params_of(gpt.GPT(VOCAB, **shape, key=jax.random.key(0))))
        moments = [params, params]
        carried = (params, (jax.ShapeDtypeStruct((), jnp.int32), *moments))
        ids = jax.ShapeDtypeStruct((batch, shape["context"]), jnp.int32)
        placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_chip), carried)
        placed_ids = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=on_chip)
        data = {"inputs": placed_ids, "targets": placed_ids}
        compiled = plain_step("bf16").lower(*placed, data).compile()
    cost = compiled.cost_analysis() or {}
    memory = Memory.of(compiled)
    text = compiled.as_text()
    if hlo:
        os.makedirs(hlo, exist_ok=True)
        with open(os.path.join(hlo, f"{shape_name.replace(' ', '_')}_{contender}.hlo"), "w") as file:
            file.write(text)
    return {
        "shape": shape_name,
        "contender": contender,
        "batch": batch,
        "flops": float(cost.get("flops", float("nan"))),
        "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
        "temporaries": memory.temporaries,
        "arguments": memory.arguments,
    }


def fresh(contender: str, shape_name: str, hlo: str | None) -> dict[str, Any]:
    """``measure`` in a new process, without the tests' simulated devices."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("XLA_FLAGS", None)
    return in_fresh_process("step_bytes", f"measure({contender!r}, {shape_name!r}, {hlo!r})", env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["6x384 ctx256"])
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--hlo", help="write each optimized program's text into this folder")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for shape_name in args.shapes:
        for contender in args.contenders:
            row = fresh(contender, shape_name, args.hlo)
            rows.append(row)
            print(
                f"{shape_name:15} {contender:10} {row['flops']:.4e} FLOPs, "
                f"{row['bytes_accessed'] / 1e9:6.2f} GB accessed, "
                f"temporaries {row['temporaries'] / 1e9:6.3f} GB, arguments {row['arguments'] / 1e9:6.3f} GB",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as file:
                    json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
