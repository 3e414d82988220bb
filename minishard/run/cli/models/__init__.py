"""The models ``minishard train`` and ``explain`` know: one ``ModelEntry`` each, in ``MODELS``.

An entry is everything the command line knows about a model, in one place:
its flags and their defaults (training defaults too: epochs or steps, the
batch, the learning rate), its data sets, its default style, its ``Task``
(loss, metrics, evaluation), its optimizer, its builder, and, to run under a
pipeline, how its blocks stack on "stage". The flag checker, ``train``'s loop
and ``explain`` ask the entry; adding a model is adding an entry: a module
for it in this package, and its name in ``MODELS``, the one place that lists them.

The package: ``entry`` (``ModelEntry`` and its parts), what models share
(``images``: SGD and the image data; ``transformer``: the shape flags), and
one module per model, named for it: ``mlp``, ``vit``, ``gpt``.

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
