"""Every link of minishard.hardware, re-derived with its unit from the sentence it comes from.

Sources: jax-ml/scaling-book (``tpus.md`` at 0819a7d, ``gpus.md`` at 1a55377), and for the A100's
network ServeTheHome's report of NVIDIA's Hot Chips 32 DGX A100 SuperPOD talk. Each test quotes
its sentence, derives the figure in bytes/s per device from it, and checks the table holds it.
"""

from __future__ import annotations

import dataclasses

import pytest

from minishard.costs import collective_time, critical_batch
from minishard.hardware import HARDWARE, HOST_DCN, NIC
from minishard.layouts import Layout

GB = 1e9


def test_nvlink_4_gives_each_h100_450_gb_per_second_inside_a_node_of_8() -> None:
    # gpus.md: "each NVLink link has 25GB/s of full-duplex bandwidth (50GB/s for B200), giving us
    # `18 * 25=450GB/s` of full-duplex bandwidth from each GPU into the network"
    for name in ("h100", "h200"):
        assert HARDWARE[name].link_bandwidth == 18 * 25 * GB and HARDWARE[name].node == 8
    assert HARDWARE["b200"].link_bandwidth == 18 * 50 * GB
    # the NVLink table: "Ampere | 25 | 12 | 300": NVLink 3, 12 ports of 25 GB/s
    assert HARDWARE["a100"].link_bandwidth == 12 * 25 * GB


def test_an_h100_s_infiniband_nic_is_400_gigabits_50_gigabytes_a_second() -> None:
    # gpus.md: "each box in the bottom row is a single 8xH100 node with 8 GPUs, 8 400Gbps CX7 NICs
    # (one per GPU)"; "each node has 8x400Gbps NDR IB cables ..., giving each node
    # `8 * 400 / 8 = 400 GB/s` of bandwidth to the leaf"
    per_gpu = 400e9 / 8  # bits to bytes
    assert NIC["ConnectX-7"] == per_gpu == 50 * GB
    for name in ("h100", "h200", "b200"):
        assert HARDWARE[name].scale_out == per_gpu
        # the node table: "H100 | 8 | 450e9 | 400e9"; "B200 | 8 | 900e9 | 400e9" (node egress)
        assert HARDWARE[name].scale_out * HARDWARE[name].node == 400 * GB


def test_an_a100_s_hdr_nic_is_200_gigabits_25_gigabytes_a_second() -> None:
    # ServeTheHome, "NVIDIA DGX A100 SuperPod Detailed Look" (Hot Chips 32): "the new DGX A100 now
    # uses a 1:1 GPU to NIC ratio", "we now get 2x 200Gbps HDR IB adapters for two GPUs"
    assert HARDWARE["a100"].scale_out == NIC["HDR"] == 200e9 / 8 == 25 * GB
    # gpus.md's table: "A100 | Ampere | 2.0e12 | 3.1e14": HBM bytes/s and bf16 FLOP/s (312 TFLOP/s)
    assert HARDWARE["a100"].hbm_bandwidth == 2.0e12 and round(HARDWARE["a100"].flops, -13) == 3.1e14


@pytest.mark.parametrize(("name", "chips_a_host"), [("v4p", 4), ("v5p", 4), ("v5e", 8), ("v6e", 8)])
def test_a_tpu_s_dcn_share_is_its_host_s_over_its_chips(name: str, chips_a_host: int) -> None:
    # tpus.md: "DCN bandwidth is typically around `2.5e10` bytes / second per host"; the chip table's
    # host sizes: "2x2x1" for v4p and v5p (4 chips), "4x2" for v5e and v6e (8)
    assert HOST_DCN == 2.5e10
    assert HARDWARE[name].scale_out == HOST_DCN / chips_a_host


SLICES = [("v4p", 16**3), ("v5p", 16 * 20 * 28), ("v5e", 16**2), ("v6e", 16**2)]


@pytest.mark.parametrize(("name", "slice_chips"), SLICES)
def test_an_ici_slice_is_at_most_a_pod(name: str, slice_chips: int) -> None:
    # tpus.md: "the maximum pod size (called a **superpod**) is `16x16x16` for TPU v4 and `16x20x28`
    # for TPU v5p"; "TPU v5e and v6e (Trillium) cannot expand beyond a 16x16 torus but pods can still
    # communicate with each other over standard Data Center Networking (DCN)"
    assert HARDWARE[name].node == slice_chips


@pytest.mark.parametrize(("name", "bidi"), [("v4p", 9e10), ("v5p", 1.8e11), ("v5e", 9e10), ("v6e", 1.8e11)])
def test_ici_links_are_the_tables_bidirectional_bandwidth(name: str, bidi: float) -> None:
    # tpus.md, its ICI table: "TPU v5p | 9e10 | 1.8e11" (one-way, bidi bytes/s per link) ...
    assert HARDWARE[name].link_bandwidth == bidi


def test_a_dimension_runs_on_the_level_it_spans() -> None:
    h100 = HARDWARE["h100"]
    # Inside a node: NVLink, 450 GB/s
    assert h100.bandwidth(8) == 450 * GB
    # A ring over whole nodes: the node's 8 NICs, "T = bytes / W_node egress", 400 GB/s
    assert h100.bandwidth(16) == 400 * GB
    # gpus.md: "T_comms in scale-out network = bytes / W_node egress · D_node / max(D_node, Y)":
    # an outer dimension with 8-way tp inside it has one device a node, its own NIC: 50 GB/s
    assert h100.bandwidth(16, inner=8) == 50 * GB
    assert h100.bandwidth(16, inner=2) == 4 * 50 * GB  # four of its devices a node
    # a pipeline's send goes from one GPU to one GPU: its own NIC, whatever the group
    assert h100.bandwidth(16, point_to_point=True) == 50 * GB
    # The book's DP rule beyond a node: "BS > 990e12 / 400e9 = 2475" (a ring over whole nodes)
    assert round(h100.flops / h100.bandwidth(64)) == 2475
    # A TPU inside its slice keeps ICI's links; across slices, DCN through its hosts
    v5p = HARDWARE["v5p"]
    assert v5p.bandwidth(8960, n_axes=3) == 3 * 1.8e11
    assert v5p.bandwidth(2, inner=8960) == HOST_DCN / 4  # one chip a slice: its share of its host's


def test_fsdp_over_nodes_beside_tp_in_a_node_sends_8_times_slower_than_the_old_400_gb() -> None:
    layout, h100 = Layout(fsdp=256, tp=8), HARDWARE["h100"]
    assert layout.inner("fsdp") == 8 and layout.inner("tp") == 1
    weights = 2 * 70e9 / 8  # a tensor shard of 70B bf16 weights, gathered over fsdp
    now = collective_time("all-gather", weights, 256, h100, inner=layout.inner("fsdp"))
    old = dataclasses.replace(h100, scale_out=400 * GB)  # the figure before issue 63, "per GPU"
    before = collective_time("all-gather", weights, 256, old, inner=8)
    assert now / before == pytest.approx(8)


def test_a_count_beyond_a_node_without_a_scale_out_figure_is_refused_in_one_line() -> None:
    island = dataclasses.replace(HARDWARE["h100"], name="island", scale_out=None)
    assert island.bandwidth(8) == 450 * GB  # inside its node it needs none
    with pytest.raises(ValueError, match=r"^island: 16 devices span more than a node of 8, .* scale_out"):
        island.bandwidth(16)
    with pytest.raises(ValueError, match="island: 16 devices"):
        critical_batch(island, devices=16)
