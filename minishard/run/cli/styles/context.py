"""``ContextStyle``: ``--parallel cp`` and ``dp+cp``, a model's attention a ring (docs/context.md);
composed with ep (``dp+cp+ep``) it carries the experts' entry inside it (``Style.inner``).

The sequence over "context": a model with a sequence (its entry's ``SequenceSplit``)
has its attention cores made rings (``minishard.context``), and ``explain`` compiles the
step to count the ring's collective-permutes against the formula and show its balance.

>>> ContextStyle("dp+cp").mesh(8)
{'data': 2, 'context': 4}
"""

from __future__ import annotations

from typing import Any

from minishard import composition
from minishard.census import instructions
from minishard.optim import Optimizer
from minishard.run.cli.flags import Error
from minishard.run.cli.models.entry import ModelEntry
from minishard.run.cli.styles.composed import by_dimension
from minishard.run.cli.styles.style import Args, Style
from minishard.sharding import ShardedFunction
from minishard.styles import SPLITS

__all__ = ["ContextStyle"]


class ContextStyle(Style):
    """``cp``, ``dp+cp``: the sequence over "context", the model's attention a ring
    (``minishard.context``).

    Its step is ``fit``'s ``Sharded`` one: the model's loss deals each batch out zig-zag (the GPT's:
    ``run.next_token.in_chunk_order``) and its ``"ring"`` attention cores send K and V round the
    devices of "context" (``ModelEntry.sequence``). ``explain`` compiles the step and shows the
    ring.
    """

    compiles = True

    def finish(self, args: Args, error: Error) -> None:
        if args.explicit:
            error(
                f"argument --explicit: --parallel {self.name} runs ring attention's shard_map on an Auto mesh"
            )

    def check_explain(self, args: Args, model: ModelEntry, error: Error) -> None:
        self._check_context(args, model, self.mesh(args.devices), error)
        super().check_explain(args, model, error)

    def check(self, args: Args, model: ModelEntry, error: Error) -> None:
        self._check_context(args, model, args.mesh, error)  # --mesh's "context" devices, as it runs
        super().check(args, model, error)

    def _check_context(self, args: Args, model: ModelEntry, mesh: dict[str, int], error: Error) -> None:
        if model.sequence is None:
            error(f"argument --parallel: {self.name} splits a sequence, and the {model.label} has none")
        flag = model.sequence.flag
        p = int(mesh.get("context", 1))
        if (length := getattr(args, flag, None) or model.defaults[flag]) % (2 * p):
            error(
                f"argument --{flag}: {length} tokens do not cut into 2 x {p} zig-zag chunks "
                f"(context={p} devices)"
            )

    def adapt(self, built: Any, model: ModelEntry) -> Any:
        """The model, every attention a ring; inside a pipeline (dp+pp+cp) its stacked blocks'."""
        assert model.sequence is not None  # checked with the flags
        return model.sequence.ring(built)

    def explain_step(
        self,
        args: Args,
        model: ModelEntry,
        step: ShardedFunction,
        optimizer: Optimizer,
        built: Any,
        batch: Any,
    ) -> int | None:
        """The ring's collective-permutes, read from the compiled ``step`` against the formula, and
        its balance; then (None) the plan's report."""
        assert model.sequence is not None  # checked with the flags
        shape = self.mesh(args.devices)
        blocks, heads, kv_heads, head_dim = model.sequence.attention(built)
        p = shape["context"]
        b = args.batch_size // shape.get("data", 1)
        # one device's K (or V)
        chunk = (b, getattr(args, model.sequence.flag) // p, kv_heads, head_dim)
        program = step.lower(built, optimizer.init(built), batch)
        options = {"blocks": blocks, "chunk": chunk, "hardware": args.hardware, "heads": heads}
        print(composition.ring_report(program, axis="context", **options))
        if self.name not in SPLITS:  # a composition: whose each collective is
            print(by_dimension(self.name, instructions(program)))
        return None
