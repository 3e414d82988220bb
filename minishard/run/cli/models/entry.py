"""``ModelEntry``: what the command line knows of one model, and the parts it is made of.

``Splits`` is the data an entry loads. The rest is what a model lets a style change, so
that no style reaches into a model: ``Stacking``, how its blocks stack on "stage" for a
pipeline; ``SequenceSplit``, how its attention becomes a ring when its sequence splits
over "context"; ``ExpertSplit``, where its mixtures of experts are, which split over
"expert". An entry without one of them (None) has nothing the style could split. Every
model's module builds its entry from these, and ``MODELS`` (the package) lists the entries.

>>> [field.name for field in dataclasses.fields(Stacking)]
['build', 'fill', 'check', 'resets']
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from minishard import pipeline
from minishard.experts import MoE
from minishard.optim import Optimizer
from minishard.run.cli.flags import DEFAULT_DEVICES, Error, Flag
from minishard.run.data import EvalData, TrainingData
from minishard.run.steps import Task

__all__ = ["Args", "NOMINAL_STEPS", "ExpertSplit", "ModelEntry", "SequenceSplit", "Splits", "Stacking"]


Args = argparse.Namespace
NOMINAL_STEPS = 1000
"""The length of the learning-rate schedule of a step that is compiled, never run."""


@dataclasses.dataclass(frozen=True)
class Splits:
    """A model's data, loaded: what it trains on, what is evaluated every period and at the end."""

    train: TrainingData
    eval: EvalData | Mapping[str, EvalData] | None  # a bare set is named "test" (MNIST: its test split)
    test: EvalData | Mapping[str, EvalData] | None = None  # evaluated once, after the last step
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # saved with every checkpoint


@dataclasses.dataclass(frozen=True)
class Stacking:
    """How a model runs under a pipeline (pp, dp+pp): its blocks stacked on a "stage" axis."""

    build: Callable[[Args, jax.Array], pipeline.StackedModel]
    fill: Callable[[Args, int], None]  # the defaults for this many stages: one block per stage
    check: Callable[[Args, int, Error], None]  # its blocks split over this many stages
    resets: tuple[str, ...] = ()  # its flags whose default a pipeline decides (the MLP's --layers)


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """How a model runs with its sequence over "context" (cp, dp+cp): every attention core a ring.

    Its loss deals each batch out in the ring's chunk order, wherever the rules split "seq".
    """

    flag: str  # the flag of the sequence's length in tokens (the GPT's "context")
    ring: Callable[[Any], Any]  # the built model, every attention core "ring" (minishard.context)
    # the built model's (attention layers, query heads, key/value heads, head_dim)
    attention: Callable[[Any], tuple[int, int, int, int]]


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """Where a model's mixtures of experts are (ep, dp+ep), and inputs for a forward pass that counts
    their routings (``collect(MoEStats, model)(inputs)``)."""

    flag: str  # the flag of the experts per layer (0: dense MLPs)
    layers: Callable[[Any], tuple[MoE, ...]]  # the built model's MoE layers, first to last
    inputs: Callable[[Args, Any], jax.Array]  # (args, built): a batch of random inputs, args.batch_size


def _nothing(*args: Any) -> None:
    """An entry's hook with nothing to do."""


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model of the command line (``--model NAME``): see the module's docstring.

    ``flags`` are the model's own (another model's run refuses them); ``defaults``
    holds a default for each of them, and the training defaults the model sets
    (``epochs`` or ``steps``, ``batch_size``, ``lr``, ...). ``data(args)`` loads its
    ``Splits``; ``optimizer(args, total_steps)`` builds its optimizer;
    ``example(args, batch_size)`` is the shapes of one batch (``explain`` compiles
    a step on them); ``fill`` derives defaults from others, ``check`` checks its
    flags together (``argparse``'s one ``error`` line); ``explain_flags`` are those
    of its flags that change the step ``explain`` prices, ``check_explain`` checks
    them (explain takes no training flags). What a style may change, the styles
    ask here: ``stack`` (pp), ``sequence`` (cp), ``experts`` (ep), and ``sample``
    asks ``stream``. ``devices`` is its default run's device count (its own style, no
    ``--mesh``) and the reason ``train`` prints. Every checkpoint keeps ``saved(args)``
    and the ``Splits``' ``info``: what ``sample`` needs to rebuild the model without its data.
    """

    name: str
    label: str  # how messages name it: "only the ViT takes it"
    help: str
    flags: Mapping[str, Flag]
    defaults: Mapping[str, Any]
    datasets: tuple[str, ...]  # --dataset's choices for it; the first is the default
    style: str | None  # the default --parallel (None: the mesh data=2,model=4 with its rules)
    task: Task
    build: Callable[[Args, jax.Array], Any]
    data: Callable[[Args], Splits]
    optimizer: Callable[[Args, int], Optimizer]
    example: Callable[[Args, int], dict[str, jax.ShapeDtypeStruct]]
    fill: Callable[[Args], None] = _nothing
    check: Callable[[Args, Error], None] = _nothing
    explain_flags: tuple[str, ...] = ()
    check_explain: Callable[[Args, Error], None] = _nothing
    stack: Stacking | None = None  # None: it has no blocks to stack, so no pipeline style
    sequence: SequenceSplit | None = None  # None: it has no sequence to split, so no cp, dp+cp
    experts: ExpertSplit | None = None  # None: it has no experts, so ep and dp+ep have none to split
    stream: Callable[..., Iterator[list[int]]] | None = None  # decoding (``minishard sample``), gpt's
    devices: tuple[int, str] = (DEFAULT_DEVICES, "")  # its default run's --devices, and why (none: the CLI's)

    def expert_count(self, args: Args) -> int:
        """Experts per layer in this run: 0 for dense MLPs, or a model that takes no experts."""
        return int(getattr(args, self.experts.flag, 0) or 0) if self.experts else 0

    def compiled_optimizer(self, args: Args) -> Optimizer:
        """The optimizer of a step ``explain`` only compiles (a schedule's length does not change it)."""
        return self.optimizer(args, NOMINAL_STEPS)

    def saved(self, args: Args) -> dict[str, Any]:
        """What a checkpoint keeps of this run's model: its name, data set, flags and style (JSON)."""
        flags = {name: getattr(args, name) for name in self.flags}
        return {"model": self.name, "dataset": args.dataset, "flags": flags, "parallel": args.parallel}
