"""``ContextStyle``: ``--parallel cp`` and ``dp+cp``, the GPT with ring attention (docs/context.md).

The sequence over "context": the GPT's attention cores become rings
(``minishard.context``), and ``explain`` compiles the step to count the ring's
collective-permutes against the formula and show its balance.

>>> ContextStyle("dp+cp").mesh(8)
{'data': 2, 'context': 4}
"""

from __future__ import annotations

from typing import Any

import jax

from minishard import context
from minishard.optim import Optimizer
from minishard.run.cli.flags import Error
from minishard.run.cli.models.entry import ModelEntry
from minishard.run.cli.styles.style import Args, Style
from minishard.sharding import ShardedFunction

__all__ = ["ContextStyle"]


class ContextStyle(Style):
    """``cp``, ``dp+cp``: the sequence over "context", the GPT's attention a ring (``minishard.context``).

    Its step is the preset's: the GPT's loss deals each batch out zig-zag
    (``run.next_token.in_sequence_layout``) and its ``"ring"`` attention core sends K and V
    round the devices of "context". ``explain`` compiles the step and shows the ring.
    """

    models = ("gpt",)
    """The models whose loss deals a batch out in the ring's layout."""
    compiles = True

    def finish(self, args: Args, error: Error) -> None:
        if args.explicit:
            error(
                f"argument --explicit: --parallel {self.name} runs ring attention's shard_map on an Auto mesh"
            )

    def check_explain(self, args: Args, model: ModelEntry, error: Error) -> None:
        self._check_context(args, model, self.mesh(args.devices), error)

    def check(self, args: Args, model: ModelEntry, error: Error) -> None:
        self._check_context(args, model, args.mesh, error)  # --mesh's "context" devices, as it runs

    def _check_context(self, args: Args, model: ModelEntry, mesh: dict[str, int], error: Error) -> None:
        if model.name not in self.models:
            error(f"argument --parallel: {self.name} splits a sequence, and the {model.label} has none")
        p, context = int(mesh.get("context", 1)), args.context or model.defaults["context"]
        if model.name in self.models and context % (2 * p):
            error(
                f"argument --context: {context} characters do not cut into 2 x {p} zig-zag chunks "
                f"(context={p} devices)"
            )

    def build(self, model: ModelEntry, args: Args, key: jax.Array) -> Any:
        built = model.build(args, key)
        blocks = tuple(b.replace(attention=b.attention.replace(core="ring")) for b in built.blocks)
        return built.replace(blocks=blocks)

    def explain_step(
        self, args: Args, step: ShardedFunction, optimizer: Optimizer, model: Any, batch: Any
    ) -> int | None:
        """The ring's collective-permutes, read from the compiled ``step`` against the formula, and its
        balance; then (None) the preset's report."""
        shape = self.mesh(args.devices)
        p, blocks, attention = shape["context"], len(model.blocks), model.blocks[0].attention
        b, t, heads = args.batch_size // shape.get("data", 1), args.context // p, attention.heads
        chunk = (b, t, heads, attention.width // heads)  # one device's K (or V)
        program, hardware = step.lower(model, optimizer.init(model), batch), args.hardware
        print(context.ring_report(program, axis="context", blocks=blocks, chunk=chunk, hardware=hardware))
        return None
