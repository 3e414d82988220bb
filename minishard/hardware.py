"""The accelerators ``minishard.costs`` prices a step on: what a chip offers, each number with its source.

A table of data, and the one rule of its links: over how many devices a
collective runs at which bandwidth W (``Hardware.bandwidth``), which every
formula of ``minishard.costs`` divides by.

Sources. TPUs: the scaling book's TPU chapter (jax-ml/scaling-book, ``tpus.md``):
its chip table (HBM capacity and bandwidth, bf16 FLOP/s) and its ICI table
(bidirectional bandwidth per link), about 1 µs per ICI hop from its sharding
chapter, and its torus: TPU v4 and v5p link each chip to 6 neighbours (a 3D torus,
3 axes), v5e and v6e to 4 (2D). GPUs: its GPU chapter (``gpus.md``): the FLOPs-and-bandwidth and memory
tables, and the node table: 18 NVLink 4 links x 25 GB/s = 450 GB/s of egress per
H100 or H200, 900 GB/s per B200 (NVLink 5), and 400 GB/s per GPU into the
InfiniBand fat tree beyond a node of 8. The GPU per-hop latency is an
assumption (the book's ICI figure); NCCL's small messages take longer.

>>> HARDWARE["v5p"].flops / HARDWARE["v5p"].link_bandwidth  # the ICI arithmetic intensity
2550.0
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator, as the formulas see it. Per chip: ``flops`` (peak bf16
    FLOP/s), ``hbm_bandwidth`` (bytes/s), ``hbm_bytes``. ``link_bandwidth`` is the
    W the collective formulas divide by: on a TPU torus the *bidirectional*
    bandwidth along one axis (a ring sends both ways), on a GPU the NVLink egress
    of one GPU into its switch. ``node``: GPUs behind one NVLink switch, beyond
    which ``scale_out`` (InfiniBand, per GPU) applies. ``latency``: per hop. ``axes``: the torus's
    dimensions, each a ring a mesh axis can take (a switch has one).
    """

    name: str
    flops: float
    hbm_bandwidth: float
    hbm_bytes: float
    link_bandwidth: float
    topology: str  # "torus" (TPU ICI: each chip linked to its neighbours) or "switch" (NVLink)
    latency: float = 1e-6
    node: int | None = None
    scale_out: float | None = None
    axes: int = 1

    def bandwidth(self, devices: int, n_axes: float = 1) -> float:
        """W over ``devices`` spanning ``n_axes`` mesh axes: a torus gets one link per axis; a switch
        gives each GPU its NVLink egress, and beyond a node of ``node`` GPUs the scale-out network's.

        >>> HARDWARE["v5p"].bandwidth(16, n_axes=2), HARDWARE["h100"].bandwidth(16)
        (360000000000.0, 400000000000.0)
        """
        if self.topology == "torus":
            return self.link_bandwidth * n_axes
        beyond_node = self.node is not None and devices > self.node and self.scale_out is not None
        return self.scale_out if beyond_node else self.link_bandwidth  # type: ignore[return-value]

    def peak(self, dtype: str = "bfloat16") -> float:
        """The matmul peak for operands of ``dtype``: ``flops`` for bf16 and fp16. float32 at JAX's
        default precision: a TPU's MXU runs it as one bf16 pass (the same peak; about 3 digits agree),
        a GPU's tensor cores as TF32, at half the bf16 rate.

        >>> HARDWARE["v5e"].peak("float32") / 1e12, HARDWARE["h100"].peak("float32") / 1e12
        (197.0, 495.0)
        """
        on_tensor_cores = self.topology == "switch"  # the GPUs here: NVLink switches, TF32 for float32
        return self.flops / 2 if dtype == "float32" and on_tensor_cores else self.flops


HARDWARE = {
    "v4p": Hardware("TPU v4p", 2.75e14, 1.2e12, 32e9, 9e10, "torus", axes=3),
    "v5e": Hardware("TPU v5e", 1.97e14, 8.1e11, 16e9, 9e10, "torus", axes=2),
    "v5p": Hardware("TPU v5p", 4.59e14, 2.8e12, 96e9, 1.8e11, "torus", axes=3),
    "v6e": Hardware("TPU v6e", 9.20e14, 1.6e12, 32e9, 1.8e11, "torus", axes=2),
    "h100": Hardware("H100", 9.9e14, 3.35e12, 80e9, 450e9, "switch", node=8, scale_out=400e9),
    "h200": Hardware("H200", 9.9e14, 4.8e12, 141e9, 450e9, "switch", node=8, scale_out=400e9),
    "b200": Hardware("B200", 2.25e15, 8.0e12, 192e9, 900e9, "switch", node=8, scale_out=400e9),
}


DEVICE_KINDS = {
    "TPU v4": "v4p",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H200": "h200",
    "NVIDIA B200": "b200",
}
"""``jax.Device.device_kind`` as real chips report it, to the entry of ``HARDWARE`` it is. The TPU
strings are Pallas's own (``jax/_src/pallas/mosaic/tpu_info.py``: "TPU v5 lite" is a v5e, "TPU v5"
a v5p, "TPU v6 lite" a v6e); the GPUs' are NVIDIA's product names (an H100 SXM: "80GB HBM3")."""


def chip_of(device_kind: str) -> Hardware | None:
    """The entry of the chip JAX names ``device_kind``; None for a chip the table does not hold.

    >>> chip_of("TPU v5 lite").name, chip_of("NVIDIA A100-SXM4-80GB")
    ('TPU v5e', None)
    """
    name = DEVICE_KINDS.get(device_kind)
    return HARDWARE[name] if name else None


def hardware_named(hardware: Hardware | str) -> Hardware:
    """``hardware`` itself, or the entry of ``HARDWARE`` it names; an unknown name lists the known ones."""
    if isinstance(hardware, Hardware):
        return hardware
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}: one of {', '.join(HARDWARE)}")
    return HARDWARE[hardware]


__all__ = ["DEVICE_KINDS", "HARDWARE", "Hardware", "chip_of", "hardware_named"]
