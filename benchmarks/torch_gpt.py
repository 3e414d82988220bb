"""The default GPT's training step written in PyTorch, on this CPU: the reference issue 49 names.

Issue 49 says a PyTorch GPT of the same shape trained about 1.5x more tokens per second than
minishard's default run did, and asks minishard's one-device step for 60% of the measured matmul
peak. This script is that reference, so that both numbers can be checked on the machine at hand:
nanoGPT's model at ``minishard train --model gpt``'s shape (65 characters, a context of 64, 4
pre-LayerNorm blocks of 128 features, 4 heads, a Swish MLP of 512; no biases in the attention, as
``minishard.models.attention``), its batch (16 windows), AdamW with its clipping, on random
characters. It times the step three ways, as a PyTorch user would write it:

* ``eager``: attention written out (scores, causal mask, softmax), nanoGPT's slow path;
* ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True)``, nanoGPT's fast path;
* ``compiled``: ``sdpa`` under ``torch.compile`` (Inductor's C++ kernels; minutes to compile here).

Each prints its step (best and median of ``--rounds`` rounds of ``--steps``), tokens per second and
MFU: the model FLOPs (6 x the matrices' weights x tokens + the attention's 12 x layers x width x
context x tokens, as ``minishard.costs.model_flops`` counts them: 5.29 GFLOP a step) over the step,
over the peak. The peak is PyTorch's own 512² float32 matmul, best of 50, measured as
``minishard.run.profiling.measured_peak`` measures JAX's, before and after the steps, the higher
kept; ``--peak GFLOPS`` divides by another (say, the peak a minishard run printed, to compare the
two on one scale).

PyTorch is not one of minishard's dependencies; install it beside them to run this:

    pip install torch --index-url https://download.pytorch.org/whl/cpu
    python benchmarks/torch_gpt.py                     # all three, PyTorch's own peak
    python benchmarks/torch_gpt.py --modes eager sdpa --peak 150
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

VOCAB, CONTEXT, WIDTH, DEPTH, HEADS, MLP = 65, 64, 128, 4, 4, 512
BATCH = 16
LR, BETAS, EPS, DECAY, CLIP = 3e-3, (0.9, 0.99), 1e-8, 0.1, 1.0  # minishard's GPT defaults
PARAMETERS = 816_193  # minishard's default GPT: explain --model gpt
MODES = ("eager", "sdpa", "compiled")
SIDE = 512


def model_flops() -> float:
    """nanoGPT's 6N·tokens, N the matrices' weights (the embedding is a lookup), plus the attention."""
    matrices = DEPTH * (4 * WIDTH * WIDTH + 2 * WIDTH * MLP) + WIDTH * VOCAB
    tokens = BATCH * CONTEXT
    return (6 * matrices + 12 * DEPTH * WIDTH * CONTEXT) * tokens


def build(torch: ModuleType, attention: str) -> Any:
    """The GPT as an ``nn.Module`` whose call is the loss; ``attention``: "eager" or "sdpa"."""
    nn, functional = torch.nn, torch.nn.functional

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
            self.out = nn.Linear(WIDTH, WIDTH, bias=False)
            self.register_buffer("causal", torch.ones(CONTEXT, CONTEXT, dtype=torch.bool).tril())  # nanoGPT's

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, HEADS, -1).transpose(1, 2) for z in self.qkv(x).split(WIDTH, dim=2))
            if attention == "sdpa":
                mixed = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
                mixed = scores.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(-1) @ v
            return self.out(mixed.transpose(1, 2).reshape(b, t, WIDTH))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.attention = Attention()
            self.mlp = nn.Sequential(nn.Linear(WIDTH, MLP), nn.SiLU(), nn.Linear(MLP, WIDTH))

        def forward(self, x):
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
            self.blocks = nn.Sequential(*(Block() for _ in range(DEPTH)))
            self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

        def forward(self, ids, targets):
            x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
            logits = self.head(self.norm(self.blocks(x)))
            return functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    return GPT()


def stepper(torch: ModuleType, mode: str) -> Callable[[], float]:
    """One AdamW step (decay on the matrices only, the gradients clipped to norm 1) of a fresh GPT."""
    torch.manual_seed(0)
    model = build(torch, "eager" if mode == "eager" else "sdpa")
    count = sum(p.numel() for p in model.parameters())
    if count != PARAMETERS:
        sys.exit(f"error: the reference has {count:,} parameters, minishard's GPT {PARAMETERS:,}")
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": DECAY}, {"params": others, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    loss_of = torch.compile(model) if mode == "compiled" else model
    ids = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        return loss.item()

    return step


def torch_peak(torch: ModuleType) -> float:
    """PyTorch's FLOP/s on one 512² float32 matmul, best of 50 (the first runs warm up)."""
    a = torch.ones(SIDE, SIDE)
    for _ in range(5):
        a @ a
    best = min(_timed(lambda: a @ a) for _ in range(50))
    return 2 * SIDE**3 / best


def _timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round (default 20)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--peak", type=float, help="GFLOP/s to divide by (default: PyTorch's 512² matmul)")
    args = parser.parse_args(argv)
    given = {"--steps": args.steps, "--rounds": args.rounds, "--peak": args.peak}
    for flag, value in given.items():
        if value is not None and value <= 0:
            parser.error(f"argument {flag}: must be positive, got {value}")
    try:
        import torch
    except ImportError:
        print(
            "error: PyTorch is not installed (not a minishard dependency): pip install torch",
            file=sys.stderr,
        )
        return 2
    flops, before, rows = model_flops(), torch_peak(torch), []
    for mode in args.modes:
        step = stepper(torch, mode)
        first = _timed(step)  # compiles, under torch.compile
        for _ in range(5):
            step()
        rounds = [sum(_timed(step) for _ in range(args.steps)) / args.steps for _ in range(args.rounds)]
        rows.append((mode, min(rounds), statistics.median(rounds), first))
    own = max(before, torch_peak(torch))  # measured before and after the steps: a busy minute only lowers it
    peak = args.peak * 1e9 if args.peak else own
    threads = torch.get_num_threads()
    print(f"PyTorch {torch.__version__}, {threads} threads; model FLOPs {flops / 1e9:.2f} G a step")
    print(f"peak: PyTorch's {SIDE}² matmul {own / 1e9:.0f} GFLOP/s; MFU over {peak / 1e9:.0f} GFLOP/s")
    for mode, best, median, first in rows:
        print(
            f"{mode:9} step {best * 1e3:6.1f} ms (median {median * 1e3:.1f}), first {first:.1f} s; "
            f"{BATCH * CONTEXT / best:,.0f} tokens/s, MFU {flops / best / peak:.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
