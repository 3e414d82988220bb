"""The workshop: what operates a training run, built on the textbook's public names.

Nothing here is on the reading path (``minishard/*.py`` is); read it to run
minishard, not to learn how sharding works:

* ``data``: MNIST (and cats_vs_dogs) through tensorflow-datasets, batches placed on the mesh;
  ``text_data``: tiny_shakespeare's windows of characters; ``tfds_reading``: what both read with;
* ``steps``: a train step and an evaluation as pure functions, from a ``Task`` (loss, metrics);
* ``train``: ``fit``, the loop with evaluation, checkpoints and exact resume, by epochs or by
  steps (``horizon``), on ``resume``'s promises, with ``compiling``'s report; ``errors``;
  ``settings``: ``FitSettings``, how ``fit`` trains, one object a learner prints;
* ``checkpoint``: orbax checkpoints with checksums, a lock, and every migration of older ones;
* ``distributed``, ``launch``: one run over several processes (one per host), or N local ones;
* ``profiling``: a run's speed (tokens per second, MFU, HFU under recomputation) and its profiler
  trace; ``trace_reading``: a written trace read back, step by step, device by device;
* ``render``: an ``explain`` report as a rich table, HTML, or a picture; a run's history, a trace;
* ``cli``: ``minishard train``, ``minishard explain``, ``minishard launch``; a model is one
  entry of ``cli.models`` (a module of its own there, named for it), a style with a step of its
  own one entry of ``cli.styles`` (likewise).
"""
