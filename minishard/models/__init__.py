"""Models built as a user would build them, from minishard's public API only.

* ``vit``: a Vision Transformer whose heads and MLP split like the MLP's.
"""
