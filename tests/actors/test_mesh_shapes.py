"""Mesh shapes as Monarch gives them: extents, sizes, points, slices, and results that travel."""

from __future__ import annotations

import asyncio
import traceback

import numpy as np
import pytest
from support import Echo, Fire

from actors import (
    Actor,
    ActorDied,
    ActorMesh,
    Extent,
    Point,
    ProcMesh,
    SupervisionError,
    ValueMesh,
    endpoint,
    send,
)
from actors._wire._codec import Decoder, Encoder


class Forwards(Actor):
    """Returns another mesh's results as they came (Monarch's ``return await other.ep.call()``)."""

    @endpoint
    async def forward(self, other: ActorMesh[Echo], x: int) -> ValueMesh[int]:
        return await other.add.call(x)


class Collides(Actor):
    @endpoint
    async def slice(self) -> int:
        return 1


def test_every_mesh_shape_reads_as_monarchs():
    values = ValueMesh({"hosts": 2, "gpus": 2}, [0, 1, 2, 3])
    assert isinstance(values.extent, Extent) and values.extent.labels == ["hosts", "gpus"]
    assert values.extent == {"hosts": 2, "gpus": 2}, "an extent is still the mapping it was"
    assert values.sizes == {"hosts": 2, "gpus": 2}
    assert values.size() == 4 and values.size("gpus") == 2 and values.size(["hosts", "gpus"]) == 4
    with pytest.raises(KeyError, match="no dimension 'x'"):
        values.size("x")
    assert values.get(3) == 3
    for outside in (-1, 4):  # (before: -1 was the last value, silently)
        with pytest.raises(ValueError, match=f"rank {outside} is outside this mesh's 0..3"):
            values.get(outside)
    seen = values.values()  # a list, as Monarch's: read twice
    assert sum(seen) == 6 and len(seen) == 4
    point = Point(3, {"hosts": 2, "gpus": 2})
    assert isinstance(point.extent, Extent) and point.extent.labels == ["hosts", "gpus"]
    assert point.size("gpus") == 2 and dict(point) == {"hosts": 1, "gpus": 1}


def test_slices_take_any_integer_and_refuse_what_they_cannot_honour():
    values = ValueMesh({"hosts": 2, "gpus": 3}, list(range(6)))
    assert values.slice(gpus=np.int64(1)).extent == {"hosts": 2}, "a numpy integer is an index"
    assert values.item(hosts=np.int64(1), gpus=2) == 5
    with pytest.raises(ValueError, match="step"):
        values.slice(gpus=slice(None, None, -1))  # (before: the values in their own order, silently)
    for outside in (-1, 3):  # (before: -1 was the last, silently; Monarch raises IndexError)
        with pytest.raises(IndexError, match=f"gpus={outside} is outside 0..2"):
            values.slice(gpus=outside)
    with pytest.raises(TypeError, match=r"gpus=1\.5"):
        values.item(hosts=0, gpus=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gpus='1'"):
        values.slice(gpus="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unknown dimension\(s\) \['x'\]"):
        values.slice(x=0)  # (before: a KeyError; Monarch's slice raises TypeError for a label the mesh lacks)
    assert values.slice(hosts=1, gpus=2).extent == {} and values.slice(hosts=1, gpus=2).item() == 5


def test_split_and_rename_relabel_a_mesh_keeping_its_ranks_order_and_refuse_what_does_not_fit():
    """Monarch's ``MeshTrait.split`` and ``rename`` (its examples' ``mesh.rename(host="dp", gpu="tp")``,
    ``mesh.split(host=("dp", "pp"), pp=2)``): an ``AttributeError`` here before."""
    values = ValueMesh({"hosts": 4, "gpus": 2}, list(range(8)))
    split = values.split(hosts=("dp", "pp"), pp=2)
    assert split.extent.labels == ["dp", "pp", "gpus"] and split.sizes == {"dp": 2, "pp": 2, "gpus": 2}
    assert split.values() == list(range(8)) and split.item(dp=1, pp=0, gpus=1) == 5
    assert values.split(hosts=("dp", "pp"), dp=1).sizes == {"dp": 1, "pp": 4, "gpus": 2}
    assert values.rename(hosts="dp", gpus="tp").sizes == {"dp": 4, "tp": 2}
    assert values.split(hosts=("a", "b"), gpus=("c", "d"), b=2, d=1).sizes == {"a": 2, "b": 2, "c": 2, "d": 1}
    refused = {
        "give the size of all but one": {"hosts": ("dp", "pp")},
        "3 does not divide it": {"hosts": ("dp", "pp"), "pp": 3},
        "multiply to 8": {"hosts": ("dp", "pp"), "dp": 2, "pp": 4},
        "sizes given for no split's dimension": {"hosts": ("dp",), "pp": 2},
        "appears twice": {"hosts": ("gpus",)},
        "splits into a sequence of new names": {"hosts": "dp"},
        "is no dimension of": {"pp": "two"},
    }
    for message, changes in refused.items():
        with pytest.raises(ValueError, match=message):
            values.split(**changes)


def test_value_meshes_points_and_extents_travel():
    values = ValueMesh({"hosts": 1, "gpus": 2}, [{"a": 1}, None])
    encoder = Encoder()
    for sent in (values, Extent(["hosts", "gpus"], [1, 2]), Point(1, {"hosts": 1, "gpus": 2})):
        encoder.reset()
        data = encoder.encode(sent)
        got = Decoder().decode(data, list(encoder.frames))
        assert type(got) is type(sent) and repr(got) == repr(sent)
    encoder.reset()
    got = Decoder().decode(encoder.encode(values), list(encoder.frames))
    assert got.extent.labels == ["hosts", "gpus"] and list(got.values()) == [{"a": 1}, None]


async def test_an_actor_returns_another_meshs_results(spawn):
    procs = spawn(hosts=1, gpus=2)
    echo = procs.spawn("echo", Echo, 10)
    forwards = procs.spawn("forwards", Forwards).slice(gpus=0)
    got = await asyncio.wait_for(forwards.forward.call_one(echo, 1), 30)
    assert isinstance(got, ValueMesh) and got.extent.labels == ["hosts", "gpus"] and list(got.values()) == [11, 11]


async def test_actor_and_proc_meshes_give_their_shape_and_a_point_slice_has_none(spawn):
    procs: ProcMesh = spawn(hosts=1, gpus=2)
    assert procs.extent.labels == ["hosts", "gpus"] and procs.sizes == {"hosts": 1, "gpus": 2}
    assert procs.rename(gpus="tp").sizes == {"hosts": 1, "tp": 2}
    echo = procs.spawn("echo", Echo)
    split = echo.split(gpus=("dp", "tp"), tp=1)
    assert split.sizes == {"hosts": 1, "dp": 2, "tp": 1}
    assert await asyncio.wait_for(split.slice(dp=1).add.call_one(4), 30) == 4
    assert (await asyncio.wait_for(echo.rename(gpus="tp").add.call(1), 30)).extent == {"hosts": 1, "tp": 2}
    assert echo.extent.labels == ["hosts", "gpus"] and echo.size("gpus") == 2 and echo.size() == 2
    one = echo.slice(hosts=0, gpus=1)
    assert one.extent == {} and one.size() == 1
    result = await asyncio.wait_for(one.add.call(1), 30)
    assert result.extent == {} and result.item() == 1, "no made-up 'procs' dimension"


def test_an_endpoint_named_as_a_mesh_attribute_is_refused_at_spawn(procs: ProcMesh):
    with pytest.raises(ValueError, match="collides with an endpoint name: slice"):
        procs.spawn("collides", Collides)


async def test_stopping_a_slice_stops_only_its_actors(procs: ProcMesh):
    echo = procs.spawn("echo", Echo)
    await asyncio.wait_for(echo.slice(procs=0).stop(), 30)
    assert await asyncio.wait_for(echo.slice(procs=1).add.call_one(1), 30) == 1, "the other rank answers on"
    assert await asyncio.wait_for(echo.add.choose(2), 30) == 2, "choose() picks a rank still there"
    with pytest.raises(SupervisionError, match="stopped"):
        echo.slice(procs=0).add.call_one(1)
    with pytest.raises(SupervisionError, match="stopped"):
        echo.add.call(1)
    await asyncio.wait_for(echo.stop(), 30)
    with pytest.raises(SupervisionError, match="stopped"):
        echo.slice(procs=1).add.call_one(1)


def test_choose_on_slices_taken_in_turn_reaches_every_rank_of_each():
    """Every view of a mesh shared one turn counter: a trainer choosing on the slice of host A, then of host B, and
    so on (two generators each) drew even numbers on A and odd ones on B, so only one generator of each host was
    ever chosen. Each set of ranks takes its own turns; a slice taken afresh takes them on."""
    from actors._meshes._actor_mesh import ActorMesh
    from actors._shared._liveness import ProcRef

    refs = [ProcRef(f"ipc:///nowhere/w{rank}.sock", 100 + rank) for rank in range(4)]
    mesh: ActorMesh[Echo] = ActorMesh("m", "support:Echo", {}, {"procs": 4}, list(enumerate(refs)))
    chosen: dict[int, list[int]] = {0: [], 2: []}
    for _ in range(4):
        for first in (0, 2):
            chosen[first].append(mesh.slice(procs=slice(first, first + 2))._choose()[0])
    assert chosen == {0: [0, 1, 0, 1], 2: [2, 3, 2, 3]}
    assert [mesh._choose()[0] for _ in range(4)] == [0, 1, 2, 3], "the whole mesh takes its own turns"


async def test_an_empty_slice_cannot_choose(procs: ProcMesh):
    echo = procs.spawn("echo", Echo)
    empty = echo.slice(procs=slice(2, 2))
    assert list((await empty.add.call(1)).values()) == []
    with pytest.raises(ValueError, match="no actor to choose"):
        empty.add.choose(1)
    with pytest.raises(ValueError, match="no actor to choose"):
        send(empty.add, (1,), selection="choose")


async def test_a_faulted_meshs_error_does_not_grow_with_each_call(procs: ProcMesh):
    reported = asyncio.Event()
    procs.add_failure_handler(lambda failure: reported.set())
    fire = procs.spawn("fire", Fire)
    send(fire.explode, ("nobody handles this",), selection="choose")
    await asyncio.wait_for(reported.wait(), 30)
    depths = []
    for _ in range(5):
        with pytest.raises(SupervisionError) as info:
            fire.ok.call()
        depths.append(len(traceback.extract_tb(info.value.__traceback__)))
    assert len(set(depths)) == 1, f"each raise adds the frames of the ones before it: {depths}"


async def test_a_proc_mesh_slices_as_monarchs_and_actors_spawned_on_a_slice_live_there(spawn):
    """``procs.slice(...).spawn(...)`` (Monarch's ``pm.slice(gpus=0).spawn("owner", ...)``) was an AttributeError:
    a slice is the processes at its coordinates, and its actors live in them only, ranked within the slice."""
    procs: ProcMesh = spawn(hosts=1, procs=3)
    one = procs.slice(procs=2)
    assert isinstance(one, ProcMesh) and one.extent == {"hosts": 1} and one.pids == procs.pids[2:]
    solo = one.spawn("solo", Echo, 5)
    assert len(solo) == 1 and await solo.whoami.call_one() == (procs.pids[2], 0, {"hosts": 1})
    pair = procs.slice(hosts=0, procs=slice(0, 2))
    assert pair.extent == {"procs": 2} and pair.restarts == [0, 0] and len(pair) == 2
    both = pair.spawn("both", Echo)
    seen = await both.whoami.call()
    assert [seen.get(r) for r in range(2)] == [(procs.pids[r], r, {"procs": 2}) for r in range(2)]
    assert procs.flatten("all").extent == {"all": 3} and pair.slice(procs=1).pids == procs.pids[1:2]
    with pytest.raises(ValueError, match=r"is a slice of .*: stop the proc mesh it was sliced from"):
        pair.stop()
    with pytest.raises(ValueError, match="set the logging option on the mesh it was sliced from"):
        pair.logging_option()
    with pytest.raises(TypeError, match=r"unknown dimension\(s\) \['gpus'\]"):  # (as Monarch's slice)
        procs.slice(gpus=0)
    await procs.stop()
    with pytest.raises(ActorDied):
        await solo.add.call_one(1)
