"""Models built as a user would build them, from minishard's public API only.

A model here is a tree of ``Layer``s whose parameters name their logical axes
(``param_logical_axes``) and whose activations name theirs through
``minishard.constraints`` (``activation_axes``, ``output_sharding``,
``as_activation``). It knows nothing of meshes, devices or the batch axis's
name: a style's rules (``minishard.styles``) and ``Sharded`` decide where it
runs. It imports no ``_``-prefixed name of the textbook; what it needs and the
public API lacks, the API grows. The textbook never imports it.

* ``attention``: the attention core (a pure function of positions), ring attention's core,
  KVCache and Attention;
* ``dropout``: nanoGPT's dropout, its mask drawn on the global shape from keys a learner can follow
  (step, layer, place);
* ``transformer``: what every transformer here is built from around attention: LayerNorm,
  the MLP, Block;
* ``vit``: a Vision Transformer whose heads and MLP hidden units split like the
  MLP's hidden units;
* ``gpt``: a decoder-only GPT over characters (nanoGPT's CPU shape), its
  training step, and sampling with a KV cache.
"""
