"""Fast on the chip (issue 61 §3): minishard's GPT step against a plain-JAX step of the same model.

Both on one chip, in one run, at nanoGPT's Shakespeare shape (6 x 384, context 256, batch 64) and
GPT-2 small's body (12 x 768, context 1,024), each contender timed the same way:

* ``--steps`` steps dispatched back to back and waited for at the end (the chip never waits on
  the host: what a training loop with a step in flight gets), the best of ``--rounds``;
* tokens per second, and MFU by PaLM's count, ``6N + 12·L·T·D`` FLOPs a token at the chip's
  published bf16 peak (``hardware``'s table).

The contenders:

* ``plain fp32`` / ``plain bf16``: ``benchmarks/gpt_step.py``'s hand-written step (dicts of
  arrays, one ``jax.jit``, donated state), in bf16 with every parameter cast to bf16 inside the
  loss, as ``jmp`` would, the logits' softmax in float32;
* ``minishard ...``: ``train``'s own step from its flags (``benchmarks/chip.py``'s
  ``compiled_step``): ``--precision bf16`` with ``--attention dense`` or ``flash``, a
  ``--remat`` policy, a larger batch.

Run on the chip: ``python3 benchmarks/chip_speed.py --json $OUT/speed.json``; ``--smoke`` runs a tiny
size on any device so a test can hold the script to working.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from chip import compiled_step
from gpt_step import adamw, forward, params_of

from minishard.hardware import HARDWARE, chip_of
from minishard.models import gpt

VOCAB = 65  # tiny_shakespeare's characters

SHAPES = {
    "6x384 ctx256": {"depth": 6, "width": 384, "heads": 6, "context": 256},
    "12x768 ctx1024": {"depth": 12, "width": 768, "heads": 12, "context": 1024},
}
SMOKE_SHAPES = {"tiny": {"depth": 1, "width": 32, "heads": 2, "context": 16}}
Contender = tuple[str, int, str | None, list[str]]
"""(its name, the batch, minishard's attention core or None for the plain step, minishard's flags)"""
CONTENDERS: dict[str, list[Contender]] = {
    "6x384 ctx256": [
        ("plain bf16", 64, None, []),
        ("minishard bf16 dense", 64, "dense", []),
        ("minishard bf16 flash", 64, "flash", []),
    ],
    "12x768 ctx1024": [
        ("plain bf16", 16, None, []),
        ("minishard bf16 dense", 16, "dense", []),
        ("minishard bf16 flash", 16, "flash", []),
        ("minishard bf16 flash, batch 32", 32, "flash", []),
    ],
}
SMOKE = {"tiny": [("plain bf16", 8, None, []), ("minishard bf16 dense", 8, "dense", [])]}


def plain_step(precision: str) -> Callable[..., Any]:
    """The hand-written step of ``gpt_step.py``, its forward in ``precision``, jitted with donation."""
    compute = jnp.bfloat16 if precision == "bf16" else jnp.float32

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits = forward(jax.tree.map(lambda p: p.astype(compute), params), batch["inputs"])
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1))

    def step(params: Any, state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        params, state = adamw(params, grads, state)
        return params, state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def flags_of(shape: dict[str, int], batch: int) -> list[str]:
    sizes = [f"--{name}={size}" for name, size in shape.items()]
    return ["--model", "gpt", *sizes, f"--batch-size={batch}"]


def timed(step: Callable[..., Any], carried: list[Any], batch: Any, steps: int, rounds: int) -> float:
    """Seconds a step: ``steps`` dispatched back to back, waited for at the end; the best round."""
    for _ in range(2):  # compile and warm up
        carried[0], carried[1], loss, *_ = step(*carried, batch)
    float(loss)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(steps):
            carried[0], carried[1], loss, *_ = step(*carried, batch)
        float(loss)
        best = min(best, (time.perf_counter() - started) / steps)
    return best


def contender(shape: dict[str, int], batch: int, core: str | None, flags: list[str]) -> tuple[Any, ...]:
    """(step, the state it carries, the batch it steps on): minishard's from its flags, or the plain one."""
    precision = "fp32" if "fp32" in flags else "bf16"
    flags = [flag for flag in flags if flag not in ("--precision", "fp32")]
    if core is not None:
        ms_step = compiled_step(flags_of(shape, batch) + flags, precision, core)
        return ms_step.compiled, [ms_step.built, ms_step.state], ms_step.batch
    model = gpt.GPT(VOCAB, **shape, key=jax.random.key(0))
    params = params_of(model)
    moments = [jax.tree.map(jnp.zeros_like, params) for _ in range(2)]
    ids = np.random.default_rng(0).integers(0, VOCAB, (batch, shape["context"] + 1)).astype(np.int32)
    data = jax.device_put({"inputs": ids[:, :-1], "targets": ids[:, 1:]})
    return plain_step(precision), [params, (jnp.zeros((), jnp.int32), *moments)], data


def model_flops_a_token(shape: dict[str, int], parameters: int) -> float:
    """PaLM's count (its appendix B): 6 FLOPs a parameter, and attention's 12·L·T·D."""
    return 6 * parameters + 12 * shape["depth"] * shape["context"] * shape["width"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", help="shapes whose name contains this")
    parser.add_argument("--smoke", action="store_true", help="a tiny size on any device")
    args = parser.parse_args()
    device = jax.devices()[0]
    chip = chip_of(device.device_kind) or HARDWARE["v5e"]  # off a chip (--smoke): only to run
    shapes, contenders = (SMOKE_SHAPES, SMOKE) if args.smoke else (SHAPES, CONTENDERS)
    rows = []
    for name, shape in shapes.items():
        if args.only and args.only not in name:
            continue
        reference = None
        for label, batch, core, flags in contenders[name]:
            step, carried, data = contender(shape, batch, core, flags)
            parameters = sum(leaf.size for leaf in jax.tree.leaves(carried[0]))
            seconds = timed(step, carried, data, args.steps, args.rounds)
            tokens = batch * shape["context"]
            mfu = tokens * model_flops_a_token(shape, parameters) / seconds / chip.peak("bfloat16")
            reference = reference or tokens / seconds
            row = {"shape": name, "contender": label, "batch": batch, "step_ms": seconds * 1e3}
            row |= {"tokens_per_s": tokens / seconds, "mfu": mfu, "vs_first": tokens / seconds / reference}
            rows.append(row)
            print(
                f"{name:15} {label:44} {seconds * 1e3:8.2f} ms {tokens / seconds:12,.0f} tokens/s "
                f"MFU {mfu:6.1%}  x{row['vs_first']:.2f}",
                flush=True,
            )
            del step, carried, data
            if args.json:  # after every row: a run cut short keeps what it measured
                with open(args.json, "w") as out:
                    json.dump({"device_kind": device.device_kind, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
