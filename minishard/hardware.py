"""The accelerators ``minishard.costs`` prices a step on: what a chip offers, each number with
its source.

A table of data (``HARDWARE``: each chip a ``Hardware``), and the one rule of its links:
over how many devices a collective runs at which bandwidth W (``Hardware.bandwidth``),
which every formula of ``minishard.costs`` divides by.

Every network here has two levels. GPUs: NVLink inside a node of 8, behind one switch; InfiniBand
across nodes, one NIC per GPU. TPUs: ICI inside a slice (a torus of up to a pod's chips); DCN
across slices (multislice), through each host. A dimension whose devices sit inside one node or
slice runs at the fast level's W; one that spans nodes runs at its devices' NICs: as many of them
as the dimension has devices in one node (the scaling book's "the cost of the outer reduction is
reduced by a factor of the number of nodes spanned by the inner axis").

Sources, every figure in bytes/s per device (tests/test_hardware.py quotes each sentence).
TPUs: the scaling book's TPU chapter (jax-ml/scaling-book, ``tpus.md``): its chip table (HBM
capacity and bandwidth, bf16 FLOP/s, pod size, host size), its ICI table (bidirectional bandwidth
per link), "DCN bandwidth is typically around 2.5e10 bytes / second per host" (a v5p host holds
4 chips, a v5e or v6e host 8); about 1 µs per ICI hop from its sharding chapter; its torus:
TPU v4 and v5p link each chip to 6 neighbours (3 axes), v5e and v6e to 4 (2). GPUs: its GPU
chapter (``gpus.md``): the FLOPs-and-bandwidth and memory tables; 18 NVLink 4 links x 25 GB/s =
450 GB/s of egress per H100 (NVLink 5: 900 GB/s per B200; NVLink 3, 12 links: 300 GB/s per A100);
and beyond the node "8 400Gbps CX7 NICs (one per GPU)": 400 Gb/s = 50 GB/s per GPU, 400 GB/s a
node. The A100's is the DGX A100's (ServeTheHome on NVIDIA's Hot Chips 32 SuperPOD talk: "a
1:1 GPU to NIC ratio", "2x 200Gbps HDR IB adapters for two GPUs"): 25 GB/s per GPU. The H200 and
B200 are taken to sit on the H100's network (the book's node table gives the B200 400e9 a node).
The GPU per-hop latency is an assumption (the book's ICI figure); NCCL's small messages take longer.
Beyond the fast level: ``HOST_DCN``, a TPU host's, and ``NIC``, a GPU's.

A running program names its chip: ``chip_of`` finds the entry of a ``jax.Device.device_kind``
(``DEVICE_KINDS``), and ``hardware_named`` the one a name (``"v5p"``) asks for.

>>> HARDWARE["v5p"].flops / HARDWARE["v5p"].link_bandwidth  # the ICI arithmetic intensity
2550.0
"""

from __future__ import annotations

import dataclasses

from minishard import _checks_costs


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator, as the formulas see it. Per chip: ``flops`` (peak bf16
    FLOP/s), ``hbm_bandwidth`` (bytes/s), ``hbm_bytes``. ``link_bandwidth`` is the
    W the collective formulas divide by: on a TPU torus the *bidirectional*
    bandwidth along one axis (a ring sends both ways), on a GPU the NVLink egress
    of one GPU into its switch. ``node``: the devices of the fast level (GPUs behind one
    NVLink switch, TPUs of one ICI slice), beyond which ``scale_out`` applies: bytes/s of
    *one device's* share of the slow level (a GPU's InfiniBand NIC, a TPU's of its host's DCN).
    ``latency``: per hop. ``axes``: the torus's dimensions, each a ring a mesh axis can take
    (a switch has one).
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

    def bandwidth(
        self, devices: int, n_axes: float = 1, inner: int = 1, point_to_point: bool = False
    ) -> float:
        """W over ``devices`` spanning ``n_axes`` mesh axes, each ``inner`` devices apart (the
        product of the dimensions placed inside this one): a torus gets one link per axis, a switch
        each GPU's NVLink egress, while the group sits in one ``node``. Beyond it, each of the
        group's devices in one node sends through its own NIC: ``scale_out`` times those devices
        (a ring over nodes, the book's node egress, 400 GB/s for 8 H100), no more than the fast
        level gives; a ``point_to_point`` send (a pipeline's) has its own NIC alone.

        >>> h100 = HARDWARE["h100"]
        >>> h100.bandwidth(8), h100.bandwidth(16), h100.bandwidth(16, inner=8)   # NVLink; 8 NICs; 1
        (450000000000.0, 400000000000.0, 50000000000.0)
        """
        fast = self.link_bandwidth * n_axes if self.topology == "torus" else self.link_bandwidth
        if self.node is None or devices * inner <= self.node:
            return fast
        _checks_costs.scale_out(self.name, self.scale_out, devices * inner, self.node)
        # the group's devices in a node
        per_node = 1 if point_to_point else max(1, self.node // inner)
        return min(fast, self.scale_out * per_node)  # type: ignore[operator]

    def peak(self, dtype: str = "bfloat16") -> float:
        """The matmul peak for operands of ``dtype``: ``flops`` for bf16 and fp16. float32 at
        JAX's default precision: a TPU's MXU runs it as one bf16 pass (the same peak; about 3
        digits agree), a GPU's tensor cores as TF32, at half the bf16 rate.

        >>> HARDWARE["v5e"].peak("float32") / 1e12, HARDWARE["h100"].peak("float32") / 1e12
        (197.0, 495.0)
        """
        on_tensor_cores = self.topology == "switch"  # the GPUs here (NVLink): TF32 for float32
        return self.flops / 2 if dtype == "float32" and on_tensor_cores else self.flops


HOST_DCN = 2.5e10
"""DCN bytes/s of one TPU host, the TPU chapter's; a v4 or v5p host holds 4 chips, a v5e or
v6e 8."""
NIC = {"ConnectX-7": 400e9 / 8, "HDR": 200e9 / 8}
"""Bytes/s of one GPU's InfiniBand NIC: 400 Gb/s (NDR, an H100's ConnectX-7), 200 Gb/s (an
A100's HDR)."""

HARDWARE = {
    "v4p": Hardware(  # a pod of 16**3 chips, 4 to a host
        "TPU v4p", 2.75e14, 1.2e12, 32e9, 9e10, "torus", axes=3, node=16**3, scale_out=HOST_DCN / 4
    ),
    "v5e": Hardware(  # a pod of 16**2 chips, 8 to a host
        "TPU v5e", 1.97e14, 8.1e11, 16e9, 9e10, "torus", axes=2, node=16**2, scale_out=HOST_DCN / 8
    ),
    "v5p": Hardware(  # a pod: 16 x 20 x 28 = 8960 chips, 4 to a host
        "TPU v5p", 4.59e14, 2.8e12, 96e9, 1.8e11, "torus", axes=3, node=8960, scale_out=HOST_DCN / 4
    ),
    "v6e": Hardware(  # a pod of 16**2 = 256 chips, 8 to a host
        "TPU v6e", 9.20e14, 1.6e12, 32e9, 1.8e11, "torus", axes=2, node=256, scale_out=HOST_DCN / 8
    ),
    "a100": Hardware("A100", 3.12e14, 2.0e12, 80e9, 300e9, "switch", node=8, scale_out=NIC["HDR"]),
    "h100": Hardware(  # NVLink 4 inside a node of 8; beyond it, a ConnectX-7 NIC per GPU
        "H100", 9.9e14, 3.35e12, 80e9, 450e9, "switch", node=8, scale_out=NIC["ConnectX-7"]
    ),
    "h200": Hardware(  # on the H100's network
        "H200", 9.9e14, 4.8e12, 141e9, 450e9, "switch", node=8, scale_out=NIC["ConnectX-7"]
    ),
    "b200": Hardware(  # NVLink 5, on the H100's network beyond the node
        "B200", 2.25e15, 8.0e12, 192e9, 900e9, "switch", node=8, scale_out=NIC["ConnectX-7"]
    ),
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
    """``hardware`` itself, or the entry of ``HARDWARE`` it names; an unknown one lists them."""
    if isinstance(hardware, Hardware):
        return hardware
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}: one of {', '.join(HARDWARE)}")
    return HARDWARE[hardware]


__all__ = ["DEVICE_KINDS", "HARDWARE", "HOST_DCN", "NIC", "Hardware", "chip_of", "hardware_named"]
