"""The memory chapter against XLA:TPU, compiled ahead of time here: predicted and compiled, term by term.

For the GPT at three sizes (the default; 6 x 384, 6 heads, context 256, batch 64; 12 x 768, 12 heads,
context 1,024, batch 16), in fp32 and bf16, under each ``--remat`` policy: ``train``'s step (one
device, model and state donated) compiled by XLA:TPU for one v5e chip (``v5e:1x1``, libtpu, no chip
needed), and beside it ``memory.budget`` (what ``explain --memory`` prints).

Term by term: XLA:TPU writes its buffer assignment (``--xla_dump_to``), and its live-range file lists
every buffer live at the step's peak. Each is named by its shape: ``[b, heads, s, s]`` the softmax's,
``[b, s, hidden]`` the MLP's, ``[b, s, width]`` the residual stream's, ``[b, s, heads, head_dim]``
q, k, v and attention's output, ``[b, s, vocab]`` the logits, a parameter's shape a gradient; each
in the dtype XLA:TPU keeps it in. That is what the chapter's ``kept_on_tpu`` terms were read from.

    python3 benchmarks/memory_aot.py                     # every case (12 x 768: minutes each)
    python3 benchmarks/memory_aot.py --only 6x384 --terms   # one size, with the peak's buffers

Compiled results are cached (``--cache``, keyed by the flags and the jax version): a second run
prints at once.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

SIZES = {
    "default": ["--model", "gpt"],
    "6x384": [
        *("--model", "gpt", "--depth", "6", "--width", "384", "--heads", "6"),
        *("--context", "256", "--batch-size", "64"),
    ],
    "12x768": [
        *("--model", "gpt", "--depth", "12", "--width", "768", "--heads", "12"),
        *("--context", "1024", "--batch-size", "16"),
    ],
}
PRECISIONS = ("fp32", "bf16")
POLICIES = ("none", "full", "dots", "names")
TPU = ("--topology", "v5e:1x1")
"""One TPU v5e chip, compiled for by libtpu here."""
CACHE = os.path.join(tempfile.gettempdir(), "minishard-memory-aot.json")


def read_json(path: str) -> Any:
    """``path``'s JSON, or an empty dict where there is none yet."""
    if not os.path.exists(path):
        return {}
    with open(path) as file:
        return json.load(file)


def write_json(path: str, value: Any) -> None:
    with open(path, "w") as file:
        json.dump(value, file, indent=1)


def read(path: str) -> str:
    with open(path) as file:
        return file.read()


def compile_here(flags: list[str]) -> dict[str, Any]:
    """In this process (its XLA_FLAGS set by ``compiled``): XLA:TPU's memory_analysis of train's step."""
    import jax

    from minishard.run.cli import parse_args
    from minishard.run.cli.memory import compiled_memory, predict

    args = parse_args(["explain", "--memory", *TPU, *flags])
    _, step_args, shape, rules = predict(args)
    memory = compiled_memory(args, step_args, shape, rules, args.topology_devices)
    return {
        "arguments": memory.arguments,
        "outputs": memory.outputs,
        "temporaries": memory.temporaries,
        "aliased": memory.aliased,
        "jax": jax.__version__,
    }


def compiled(flags: list[str], cache: dict[str, Any], terms: bool) -> dict[str, Any]:
    """XLA:TPU's numbers for ``flags``, from the cache or compiled in a child process (its own dump)."""
    key = " ".join(flags)
    if key in cache and (not terms or "vmem" in cache[key]):
        return dict(cache[key])
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        if terms:
            env["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train"
        here = os.path.dirname(os.path.abspath(__file__))
        call = f"print(json.dumps(memory_aot.compile_here({flags!r})))"
        code = f"import json, sys; sys.path.insert(0, {here!r}); import memory_aot; {call}"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if out.returncode:
            return {"error": out.stderr.strip().splitlines()[-1]}
        found = json.loads(out.stdout.strip().splitlines()[-1])
        if terms:
            found["peak"] = peak_buffers(dump)
            found["vmem"] = vmem_bytes(dump)
    cache[key] = found
    return dict(found)


def peak_buffers(dump: str) -> list[tuple[str, str, int]]:
    """Every buffer live at the peak of XLA:TPU's live ranges: (its name, its shape, its bytes)."""
    live = read(glob.glob(f"{dump}/*train_step*live-range.txt")[0])
    hlo = read(glob.glob(f"{dump}/*train_step*after_optimizations.txt")[0])
    shapes = {}
    for line in hlo.splitlines():
        found = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) [\w\-]+\(", line)
        if found:
            shapes[found.group(1)] = re.findall(r"[a-z]+[0-9]*\[[\d,]*\]", found.group(2))
    peak = live.split("(peak):")[1].split("Stack trace")[0]
    buffers = []
    for name, index, size in re.findall(r"^\s+([\w.\-]+)\{([\d,]*)\}: (\d+) bytes", peak, re.M):
        parts = shapes.get(name, ["?"])
        at = int(index.split(",")[0]) if index and len(parts) > 1 else 0
        buffers.append((name, parts[min(at, len(parts) - 1)], int(size)))
    return buffers


def vmem_bytes(dump: str) -> int:
    """What XLA:TPU's memory-space assignment placed in VMEM: its allocations there, from the buffer
    assignment's memory-usage report ("Memory Space: vmem (color=1)"), none of which the HBM
    temporaries count."""
    report = read(glob.glob(f"{dump}/*train_step*memory-usage-report.txt")[0])
    found = re.search(r"Memory Space: vmem \(color=1\)\nTotal bytes: (\d+)", report)
    return int(found.group(1)) if found else 0


def classify(buffers: list[tuple[str, str, int]], sizes: dict[str, int]) -> dict[str, int]:
    """The peak's buffers by what they hold, read from their shapes (``sizes``: the step's b, s, ...)."""
    b, s, w, h, d, f, v = (sizes[k] for k in ("b", "s", "width", "heads", "head_dim", "hidden", "vocab"))
    kinds = {
        (b, h, s, s): "softmax",
        (b, s, f): "mlp hidden",
        (b, s, w): "stream",
        (b * s, w): "stream",
        (b, s, h, d): "q, k, v, out",
        (1, b, s, h, d): "q, k, v, out",
        (3, b, s, h, d): "q, k, v, out",
        (b, h, d, s): "q, k, v, out",
        (b, s, v): "logits",
        (b * s, v): "logits",
    }
    found: dict[str, int] = collections.Counter()
    for name, shape, size in buffers:
        dtype, dims = shape.split("[")[0], tuple(int(n) for n in shape[:-1].split("[")[1].split(",") if n)
        kind = "arguments" if name.startswith("args_") else f"{kinds.get(dims, 'other')} ({dtype})"
        found[kind] += size
    return dict(found)


def sizes_of(flags: list[str]) -> dict[str, int]:
    from minishard.run.cli import parse_args

    args = parse_args(["explain", "--memory", *TPU, *flags])
    hidden = args.mlp_ratio * args.width
    return {
        "b": args.batch_size,
        "s": args.context,
        "width": args.width,
        "heads": args.heads,
        "head_dim": args.width // args.heads,
        "hidden": hidden,
        "vocab": 65,
    }


def predicted(flags: list[str]) -> dict[str, Any]:
    from minishard.run.cli import parse_args
    from minishard.run.cli.memory import predict

    budget = predict(parse_args(["explain", "--memory", *TPU, *flags]))[0]
    return {"terms": budget.terms, "arguments": budget.arguments, "temporaries": budget.temporaries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="sizes, precisions or policies whose name contains this")
    parser.add_argument("--terms", action="store_true", help="the peak's buffers by kind (dumps HLO)")
    parser.add_argument("--cache", default=CACHE)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    cache = read_json(args.cache)
    rows = []
    for size, base in SIZES.items():
        for precision in PRECISIONS:
            for policy in POLICIES:
                name = f"{size} {precision} remat={policy}"
                if args.only and not all(part in name for part in args.only.split()):
                    continue
                flags = [*base, "--precision", precision, "--remat", policy]
                seen = compiled(flags, cache, args.terms)
                write_json(args.cache, cache)
                guess = predicted(flags)
                row = {"case": name, "predicted": guess, "compiled": seen}
                rows.append(row)
                if "error" in seen:
                    print(f"{name:28} compile failed: {seen['error']}", flush=True)
                    continue
                ratio = guess["temporaries"] / seen["temporaries"] if seen["temporaries"] else float("inf")
                print(
                    f"{name:28} temporaries predicted {guess['temporaries'] / 1e9:7.3f} GB, "
                    f"compiled {seen['temporaries'] / 1e9:7.3f} GB ({ratio:.2f}x); arguments "
                    f"{guess['arguments'] / 1e6:.1f} / {seen['arguments'] / 1e6:.1f} MB",
                    flush=True,
                )
                if args.terms and "peak" in seen:
                    kinds = classify(seen["peak"], sizes_of(flags))
                    for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
                        print(f"    at the peak: {kind:26} {n / 1e6:10.1f} MB")
                    terms = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in guess["terms"].items())
                    print(f"    predicted: {terms}")
                    print(f"    in VMEM (memory-space assignment): {seen['vmem'] / 1e6:.1f} MB")
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
