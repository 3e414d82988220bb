"""The workshop: what operates a training run, built on the textbook's public names.

Nothing here is on the reading path (``minishard/*.py`` is); read it to run
minishard, not to learn how sharding works:

* ``data``: MNIST (and cats_vs_dogs) through tensorflow-datasets, batches placed on the mesh;
* ``checkpoint``: orbax checkpoints with checksums, a lock, and every migration of older ones;
* ``train``: ``fit``, the loop with evaluation, checkpoints and exact resume;
* ``distributed``, ``launch``: one run over several processes (one per host), or N local ones;
* ``render``: an ``explain`` report as a rich table, HTML, or a picture of the blocks;
* ``cli``: ``minishard train``, ``minishard explain``, ``minishard launch``.
"""
