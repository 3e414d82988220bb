"""Section 6: the physical reference. How fast can this machine multiply, and how close does a step get?

A jitted float32 ``1024 x 1024 @ 1024 x 1024`` matmul (2·1024³ FLOPs) is about
the best-case workload for XLA:CPU here: one big GEMM. The seed training step
(``[784, 512, 10]``, batch 128) does ``Problem.gemm_flops`` of GEMM work
(forward + backward, exact; element-wise work not counted). Its achieved
GFLOP/s as a fraction of the matmul's says how much of the machine a step
uses; the rest is small-GEMM inefficiency, element-wise work and dispatch.

The matmul and the steps take turns in one loop (blocking after each call),
so a round's fraction pairs a step with the matmul of the same iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from contenders import Problem, available, build
from harness import Stat, blocked_round

MATMUL_N = 1024


def bench_roofline(problem: Problem, names: Sequence[str], rounds: int, iters: int) -> dict[str, Any]:
    names, _ = available(names)
    contenders = build(problem, names)
    a = jax.random.normal(jax.random.key(0), (MATMUL_N, MATMUL_N), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (MATMUL_N, MATMUL_N), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    calls = {"matmul": lambda: matmul(a, b), **{name: c.step for name, c in contenders.items()}}
    blocked_round(calls, 3)  # compile and warm up
    matmul_flops = 2 * MATMUL_N**3
    rounds_samples = [blocked_round(calls, iters)[1] for _ in range(rounds)]

    def gflops(flops: int, seconds: list[float]) -> float:
        return flops / sorted(seconds)[len(seconds) // 2] / 1e9

    out: dict[str, Any] = {
        "matmul_gflops": Stat.of([gflops(matmul_flops, r["matmul"]) for r in rounds_samples]).as_json(2),
        "step_gemm_flops": problem.gemm_flops,
        "step_gflops": {},
        "fraction": {},
    }
    for name in names:
        out["step_gflops"][name] = Stat.of(
            [gflops(problem.gemm_flops, r[name]) for r in rounds_samples]
        ).as_json(2)
        fractions = []
        for r in rounds_samples:  # paired: the step and the matmul of the same iteration
            per_iter = sorted(
                (problem.gemm_flops / s) / (matmul_flops / m) for s, m in zip(r[name], r["matmul"])
            )
            fractions.append(per_iter[len(per_iter) // 2])
        out["fraction"][name] = Stat.of(fractions).as_json()
    return out
