"""The models ``minishard train`` and ``explain`` know: one ``ModelEntry`` each, in ``MODELS``.

An entry is everything the command line knows about a model, in one place:
its flags and their defaults (training defaults too: epochs or steps, the
batch, the learning rate), its data sets, its default style, its ``Task``
(loss, metrics, evaluation), its optimizer, its builder, and what it lets a
style change: how its blocks stack on "stage" (pp), its attention made a ring
(cp), where its experts are (ep), and how it decodes (``sample``). The flag
checker, ``train``'s loop, ``explain``, ``sample`` and every style ask the entry,
never the model; adding a model is adding an entry: a module for it in this
package, and its name in ``MODELS``, the one place that lists them (a GPT-like
language model reuses ``gpt``'s ``TEXT_SEQUENCE`` and ``TEXT_EXPERTS`` and takes
cp and ep as it is).

The package: ``entry`` (``ModelEntry`` and its parts), what models share
(``images``: SGD and the image data; ``transformer``: the shape flags and the
blocks' ring cores and experts), and one module per model, named for it:
``mlp``, ``vit``, ``gpt``.

>>> MODELS["vit"].defaults["width"], MODELS["mlp"].task.metrics, MODELS["gpt"].defaults["steps"]
(64, ('acc',), 2000)
"""

from __future__ import annotations

from minishard.run.cli.models.entry import ModelEntry
from minishard.run.cli.models.gpt import GPT_ENTRY
from minishard.run.cli.models.mlp import MLP
from minishard.run.cli.models.vit import VIT

__all__ = ["MODELS"]

MODELS: dict[str, ModelEntry] = {entry.name: entry for entry in (MLP, VIT, GPT_ENTRY)}
"""``--model``'s choices: one entry each."""
