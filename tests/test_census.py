"""minishard.census (``minishard.collectives``): the communication XLA inserts, made visible.

The first tests compile real programs on the 8 simulated CPU devices (see
conftest.py) and read what the SPMD partitioner wrote. Inputs are
``jax.ShapeDtypeStruct``\\ s carrying a sharding, so ``.lower()`` compiles for
160 MB arrays without allocating any. The later tests feed hand-written HLO
lines, one for each notation XLA prints.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import minishard as ms
from minishard.census import Collective, collectives, summary


def mesh_2x4() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)


def abstract(shape, mesh, spec, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


# -- real programs -------------------------------------------------------------
def test_sharded_dot_products_all_reduce_over_y():
    # 4000 pairs of 10000-element vectors; rows split over x, columns over y.
    mesh = mesh_2x4()
    pairs = abstract((4000, 10000), mesh, P("x", "y"))
    step = jax.jit(jax.vmap(jnp.vdot), out_shardings=NamedSharding(mesh, P("x")))
    found = collectives(step.lower(pairs, pairs))
    # Each device holds 2000 rows x 2500 columns, so it computes partial dot
    # products over its 2500 columns for 2000 pairs: f32[2000] per device. The
    # 4 devices along y sum their partials: one all-reduce of 2000 * 4 bytes.
    # Nothing is gathered: the 160 MB inputs never move.
    assert set(found) == {"all-reduce"}
    assert found["all-reduce"] == Collective("all-reduce", count=1, bytes=2000 * 4, mesh_axes=(("y",),))


def test_data_parallel_grads_are_all_reduced_over_data():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    # eval_shape builds the model's shapes without running its initialisers.
    model = jax.eval_shape(lambda: ms.mlp([784, 512, 10], key=jax.random.key(0)))
    params = jax.tree.map(lambda w: abstract(w.shape, mesh, P()), model)  # replicated
    images, labels = abstract((128, 784), mesh, P("data")), abstract((128, 10), mesh, P("data"))

    def loss(model, images, labels):
        return ms.cross_entropy(model(images), labels)

    found = collectives(jax.jit(jax.grad(loss)).lower(params, images, labels))
    # Every device computes gradients on its 16 examples; one all-reduce sums
    # them. XLA may fuse the four gradients into one tuple-shaped all-reduce,
    # so compare bytes, not the op count: 407,050 float32 = 1.6 MB.
    assert set(found) == {"all-reduce"}
    assert found["all-reduce"].bytes == ms.tree.tree_bytes(model) == 1_628_200
    assert found["all-reduce"].mesh_axes == (("data",),)


def test_resharding_all_gathers_the_dropped_axis():
    mesh = mesh_2x4()
    x = abstract((64, 64), mesh, P("x", "y"))
    found = collectives(jax.jit(lambda x: 2 * x, out_shardings=NamedSharding(mesh, P(None, "y"))).lower(x))
    assert set(found) == {"all-gather"}
    assert found["all-gather"].mesh_axes == (("x",),)
    assert found["all-gather"].bytes == 64 * 16 * 4  # every device ends with all rows of its 16 columns


def test_ppermute_is_a_collective_permute_along_its_axis():
    mesh = mesh_2x4()
    ring = [(i, (i + 1) % 4) for i in range(4)]
    spec = P("x", "y")
    shift = jax.shard_map(lambda b: jax.lax.ppermute(b, "y", ring), mesh=mesh, in_specs=spec, out_specs=spec)
    found = collectives(jax.jit(shift).lower(abstract((64, 64), mesh, P("x", "y"))))
    assert set(found) == {"collective-permute"}
    assert found["collective-permute"].mesh_axes == (("y",),)
    assert found["collective-permute"].bytes == 32 * 16 * 4


def test_program_without_communication_has_no_collectives():
    mesh = mesh_2x4()
    x = abstract((64, 64), mesh, P("x", "y"))
    lowered = jax.jit(lambda x: jnp.sin(x) * 2).lower(x)
    assert collectives(lowered) == {} == collectives(lowered.compile())
    assert summary({}).startswith("no collectives")


# -- hand-written HLO ------------------------------------------------------------
MESH = jax.sharding.AbstractMesh((2, 4), ("x", "y"))
XLA_MESH = "replica_groups=mesh['axis_0'=2,'axis_1'=4]"  # XLA's names for the axes of MESH


def all_reduce(groups: str, shape: str = "f32[16]{0}") -> str:
    return (
        f"  %all-reduce.3 = {shape} all-reduce({shape} %p), channel_id=1, {groups}, "
        "use_global_device_ids=true, to_apply=%add"
    )


@pytest.mark.parametrize(
    ("groups", "axes"),
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", ("y",)),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ("x",)),
        ("replica_groups={{0,1,2,3,4,5,6,7}}", ("x", "y")),
        ("replica_groups={}", ("x", "y")),  # empty: one group of every device
        ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ("y(2 of 4)",)),
        ("replica_groups={{0,5},{1,4},{2,7},{3,6}}", ("?",)),  # a diagonal: no sub-grid
        ("replica_groups=[2,4]<=[8]", ("y",)),
        ("replica_groups=[1,8]<=[8]", ("x", "y")),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", ("x",)),
        (XLA_MESH + " {'axis_1'}", ("y",)),
        (XLA_MESH + " {'axis_0'}", ("x",)),
        (XLA_MESH + " {'axis_0','axis_1'}", ("x", "y")),
        # XLA's mesh need not be yours: 4x1x2, positions filled from iota([2,4]) transposed.
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
            ("y",),
        ),
        # an explicit device order (a format not seen from jax 0.10.2 on CPU; the parser accepts it)
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=(0,4,1,5,2,6,3,7) {'axis_1'}", ("x",)),
        # 'axis_1':(1)2 is a sub-axis: axis_1's 4 devices seen as 2 x 2, the major 2 (stride 2)
        (XLA_MESH + " {'axis_1':(1)2}", ("y(2 of 4)",)),
    ],
)
def test_replica_group_notations(groups, axes):
    found = collectives(all_reduce(groups), MESH)
    assert found == {"all-reduce": Collective("all-reduce", 1, 64, (axes,))}


def test_sub_axis_groups_hold_the_right_devices():
    from minishard._hlo import _replica_groups

    line = all_reduce(XLA_MESH + " {'axis_1':(1)2}")
    assert sorted(sorted(g.tolist()) for g in _replica_groups(line, 8)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    line = all_reduce(XLA_MESH + ", device_ids=([2,2,2]T(1,0,2)) {'axis_1':(2)2}")
    assert sorted(sorted(g.tolist()) for g in _replica_groups(line, 8)) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_tuple_shapes_with_index_comments_and_dtypes():
    shape = (
        "(f32[784,512]{1,0}, f32[512]{0}, bf16[10,512]{1,0}, f16[10]{0}, s32[3]{0}, "
        "/*index=5*/u8[7]{0}, pred[5]{0}, f64[2]{0}, s64[]{:T(128)}, c64[1]{0}, s4[3]{0}, f32[<=6]{0})"
    )
    found = collectives(all_reduce("replica_groups=[2,4]<=[8]", shape), MESH)
    expected = 784 * 512 * 4 + 512 * 4 + 10 * 512 * 2 + 10 * 2 + 3 * 4 + 7 + 5 + 2 * 8 + 8 + 8 + 2 + 6 * 4
    assert found["all-reduce"].bytes == expected


def test_async_pairs_count_once_with_the_result_bytes():
    hlo = """
  %ag-start = (f32[8,128]{1,0}, f32[64,128]{1,0}) all-gather-start(f32[8,128]{1,0} %p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %ag-done = f32[64,128]{1,0} all-gather-done((f32[8,128]{1,0}, f32[64,128]{1,0}) %ag-start)
  %ar-start = bf16[1024]{0} all-reduce-start(bf16[1024]{0} %q), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
  ROOT %ar-done = bf16[1024]{0} all-reduce-done(bf16[1024]{0} %ar-start)
  %cp-start = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(f32[4]{0} %r), channel_id=3, source_target_pairs={{0,4},{4,0}}
  %cp-done = f32[4]{0} collective-permute-done((f32[4]{0}, f32[4]{0}, u32[], u32[]) %cp-start)
"""  # noqa: E501
    found = collectives(hlo, MESH)
    assert found == {
        "all-reduce": Collective("all-reduce", 1, 1024 * 2, (("x",),)),
        "all-gather": Collective("all-gather", 1, 64 * 128 * 4, (("x", "y"),)),
        "collective-permute": Collective("collective-permute", 1, 16, (("x",),)),
    }


def test_one_kind_over_several_axes_and_reduce_scatter():
    hlo = "\n".join(
        [
            all_reduce("replica_groups=[2,4]<=[8]"),
            all_reduce("replica_groups=[4,2]<=[2,4]T(1,0)"),
            "%rs = f32[2]{0} reduce-scatter(f32[8]{0} %p), replica_groups=[2,4]<=[8], dimensions={0}",
            "%a2a = f32[8]{0} all-to-all(f32[8]{0} %p), replica_groups=[2,4]<=[8], dimensions={0}",
        ]
    )
    found = collectives(hlo, MESH)
    assert list(found) == ["all-reduce", "reduce-scatter", "all-to-all"]
    assert found["all-reduce"] == Collective("all-reduce", 2, 128, (("x",), ("y",)))
    assert found["reduce-scatter"].mesh_axes == found["all-to-all"].mesh_axes == (("y",),)


def test_summary_lines():
    colls = {
        "all-reduce": Collective("all-reduce", 3, 1_628_200, (("data",),)),
        "collective-permute": Collective("collective-permute", 1, 512, (("x",), ("x", "y"))),
    }
    assert str(colls["all-reduce"]) == "all-reduce  x3  1.6 MB  over ('data',)"
    assert summary(colls).splitlines() == [
        "all-reduce          x3  1.6 MB  over ('data',)",
        "collective-permute  x1  512 B  over ('x',), ('x', 'y')",
    ]


def test_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="mesh"):
        collectives(all_reduce("replica_groups=[2,4]<=[8]"))
    with pytest.raises(ValueError, match="outside the mesh"):
        collectives(all_reduce("replica_groups={{0,9}}"), MESH)
    with pytest.raises(ValueError, match="element type"):
        collectives(all_reduce("replica_groups=[2,4]<=[8]", shape="weird[2]{0}"), MESH)


# -- bytes as the program asked for them (issue 20) ------------------------------
def test_cpu_widens_a_bf16_psum_and_as_asked_counts_it_in_bf16():
    from minishard.census import as_asked

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    psum = jax.jit(
        jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
    )
    lowered = psum.lower(abstract((8 * 1000,), mesh, P("data"), jnp.bfloat16))
    # XLA:CPU all-reduces f32: 1000 elements x 4 bytes; a GPU or TPU moves 1000 x 2.
    assert collectives(lowered)["all-reduce"].bytes == 4000
    assert collectives(as_asked(lowered), mesh)["all-reduce"].bytes == 2000


def test_as_asked_leaves_an_f32_program_alone_and_reads_jit_arguments():
    from minishard.census import as_asked

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum((x @ w).astype(jnp.float32) ** 2)))
    for dtype, expected in ((jnp.float32, 4), (jnp.bfloat16, 2)):
        lowered = grad.lower(abstract((64, 32), mesh, P(), dtype), abstract((16, 64), mesh, P("data"), dtype))
        assert collectives(as_asked(lowered), mesh)["all-reduce"].bytes == 64 * 32 * expected


def test_as_asked_counts_each_collective_in_its_own_dtype():
    """One program, two dtypes: bfloat16 summed in bfloat16, float32 in float32 (a single 'asked' dtype
    for the whole program would count one of them wrong)."""
    from minishard.census import as_asked

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    both = jax.jit(
        jax.shard_map(
            lambda x, y: (jax.lax.psum(x, "data"), jax.lax.psum(y, "data")),
            mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P()),
        )
    )  # fmt: skip
    lowered = both.lower(
        abstract((8 * 100,), mesh, P("data"), jnp.bfloat16), abstract((8 * 10,), mesh, P("data"))
    )
    assert collectives(lowered)["all-reduce"].bytes == 100 * 4 + 10 * 4  # XLA:CPU: both in float32
    assert collectives(as_asked(lowered), mesh)["all-reduce"].bytes == 100 * 2 + 10 * 4


def test_all_to_all_tuple_bytes_are_the_sum_of_its_elements():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    swap = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.all_to_all(x, "data", split_axis=1, concat_axis=0, tiled=True),
            mesh=mesh, in_specs=P("data", None), out_specs=P(None, "data"),
        )
    )  # fmt: skip
    lowered = swap.lower(abstract((64, 32), mesh, P("data", None)))
    text = lowered.compile().as_text()
    found = collectives(lowered)["all-to-all"]
    # Each device holds (8, 32) floats = 1,024 B. XLA:CPU sends them as ONE all-to-all
    # whose result is a tuple of 8 pieces, (f32[8,4], ..., f32[8,4]), one per device:
    # the census adds the pieces up, 8 x 8 x 4 x 4 = 1,024 B, not one piece's 128 B.
    assert found.bytes == 8 * 32 * 4 and found.count == 1
    from minishard._hlo import collective_instructions, shape_bytes

    shapes = [m["shape"] for m in collective_instructions(text) if m["kind"] == "all-to-all"]
    assert shapes[0].startswith("(f32[8,4]") and shapes[0].count("f32[8,4]") == 8
    assert sum(shape_bytes(shape) for shape in shapes) == 1024


# -- loops: the census counts what a call executes ----------------------------
def test_a_psum_in_a_scan_of_5_steps_counts_5_times_its_bytes():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))

    def scanned(x, steps):  # x + psum(x) / 2, `steps` times: one all-reduce per step
        return jax.lax.scan(lambda c, _: (c + jax.lax.psum(c, "x") / 2, None), x, length=steps)[0]

    def census(steps):
        step = jax.shard_map(lambda x: scanned(x, steps), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        return collectives(jax.jit(step).lower(abstract((64,), mesh, P("x"))))["all-reduce"]

    once, five = census(1), census(5)
    assert (once.count, once.bytes) == (1, 8 * 4)  # f32[8] on each device
    assert (five.count, five.bytes) == (5, 5 * 8 * 4)


def test_nested_loops_multiply_their_trip_counts():
    hlo = """
%inner (p: f32[8]) -> f32[8] {
  %ar = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups=[2,4]<=[8], to_apply=%add
}
%outer (p: f32[8]) -> f32[8] {
  %w = f32[8]{0} while(%p), condition=%c1, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
}
ENTRY %main (p: f32[8]) -> f32[8] {
  %w2 = f32[8]{0} while(%p), condition=%c2, body=%outer, backend_config={"known_trip_count":{"n":"7"}}
  %cp = f32[2]{0} collective-permute(f32[2]{0} %p), source_target_pairs={{0,4},{4,0}}
}
"""
    found = collectives(hlo, mesh_2x4())
    assert (found["all-reduce"].count, found["all-reduce"].bytes) == (21, 21 * 32)
    assert (found["collective-permute"].count, found["collective-permute"].bytes) == (1, 8)
