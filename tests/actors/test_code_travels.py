"""Code that travels with cloudpickle, only in a session that opted in (ACTORS_SEND_CODE=1); never by default."""

from __future__ import annotations

import os
import pickle
import subprocess
import textwrap
import threading

import msgpack
import pytest
from harness import last_json, run_python

import actors
from actors import DecodeError, EncodeError
from actors._wire._code import CODE_ENV
from actors._wire._codec import Decoder, Encoder
from actors._wire._ext import EXT_CODE, EXT_OBJECT

SESSION = textwrap.dedent(
    """
    import functools, json, os, sys
    from actors import Actor, ActorError, endpoint, this_host

    class Box:  # a plain class: no record of its own, so it travels pickled
        def __init__(self, v):
            self.v = v

    class Broken:
        def __init__(self, side):
            self.side = side

        def __getstate__(self):
            if self.side == "sender":
                raise RuntimeError("__getstate__ refused")
            return {"side": self.side}

        def __setstate__(self, state):
            raise RuntimeError("__setstate__ refused")

    class Runs(Actor):
        @endpoint
        async def run(self, fn, *args):
            return fn(*args)

        @endpoint
        async def make_adder(self, n):
            return lambda x: x + n  # code back to the caller

        @endpoint
        async def build(self, cls, value):
            return cls(value).doubled()

        @endpoint
        async def broken(self, side):
            return Broken(side)  # "sender": its pickling raises here; "receiver": its loading, in the caller

    def main():
        procs = this_host().spawn_procs(per_host={"procs": 2})
        runs = procs.spawn("runs", Runs)
        one = runs.slice(procs=1)
        offset = 10

        def local(x):  # a closure over a local: cloudpickle sends it by value
            return x + offset

        class Local:  # a class defined inside a function
            def __init__(self, v):
                self.v = v

            def doubled(self):
                return self.v * 2

        out = {
            "lambda": one.run.call_one(lambda x: x * 3, 7).get(timeout=30),
            "closure": [v for _, v in runs.run.call(local, 1).get(timeout=30)],
            "partial": one.run.call_one(functools.partial(pow, 2), 5).get(timeout=30),
            "builtin": one.run.call_one(len, [1, 2, 3]).get(timeout=30),
            "class": one.build.call_one(Local, 21).get(timeout=30),
            "returned": one.make_adder.call_one(5).get(timeout=30)(1),
            "object": one.run.call_one(lambda box: Box(box.v * 2), Box(4)).get(timeout=30).v,
        }
        try:
            one.run.call_one(len, Broken("sender")).get(timeout=30)
        except RuntimeError as exc:  # the object's own error, at the sender, before anything was sent
            out["sender"] = str(exc)
        try:
            runs.run.call(len, Broken("receiver")).get(timeout=30)
        except ActorError as exc:  # the receiver could not load it: the call fails, the actor lives on
            out["receiver"] = "__setstate__ refused" in str(exc)
        try:
            one.broken.call_one("sender").get(timeout=30)
        except ActorError as exc:  # the caller hears why, instead of waiting for an answer that never comes
            out["returned_unsendable"] = "return value could not be sent: __getstate__ refused" in str(exc)
        try:
            one.broken.call_one("receiver").get(timeout=30)
        except ActorError as exc:
            out["returned_unloadable"] = "could not be decoded in the calling process" in str(exc) and (
                "__setstate__ refused" in str(exc)
            )
        out["alive"] = one.run.call_one(abs, -3).get(timeout=30)
        procs.stop().get(timeout=30)
        print(json.dumps(out), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def run_session(tmp_path, allow: bool) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "session.py"
    script.write_text(SESSION)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORS_")}
    if allow:
        env[CODE_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(actors.__file__)), env.get("PYTHONPATH", "")])
    return run_python(str(script), timeout=120, env=env)


def test_with_the_switch_functions_lambdas_closures_and_classes_travel_both_ways(tmp_path):
    proc = run_session(tmp_path, allow=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out == {
        "lambda": 21,
        "closure": [11, 11],
        "partial": 32,
        "builtin": 3,
        "class": 42,
        "returned": 6,
        "object": 8,
        "sender": "__getstate__ refused",
        "receiver": True,
        "returned_unsendable": True,
        "returned_unloadable": True,
        "alive": 3,
    }


def test_without_the_switch_nothing_is_pickled_and_the_error_names_the_switch(tmp_path):
    proc = run_session(tmp_path, allow=False)
    assert proc.returncode != 0
    assert "EncodeError" in proc.stderr and "ACTORS_SEND_CODE=1" in proc.stderr, proc.stderr[-2000:]


@pytest.fixture
def switch(monkeypatch):
    """Turn the switch on or off in this process for one test."""

    def set_to(on: bool) -> None:
        if on:
            monkeypatch.setenv(CODE_ENV, "1")
        else:
            monkeypatch.delenv(CODE_ENV, raising=False)

    return set_to


def encoded(value: object) -> bytes:
    enc = Encoder()
    enc.reset()
    return enc.encode(value)


def code_record(payload: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(EXT_CODE, payload))


def test_a_code_record_is_refused_by_a_process_that_did_not_opt_in(switch):
    switch(True)
    blob = encoded([1, lambda: 2])
    switch(False)
    with pytest.raises(DecodeError, match=r"does not let code travel.*ACTORS_SEND_CODE=1"):
        Decoder().decode(blob, [])
    with pytest.raises(EncodeError, match="code does not travel by default"):
        encoded(lambda: 2)


class Canary:
    """Pickling this runs ``_touch`` on load: proof that a refused record was never unpickled."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (os.environ["CANARY_DIR"],))


def test_without_the_switch_a_hostile_pickle_is_not_loaded(switch, tmp_path, monkeypatch):
    canary = tmp_path / "ran"
    monkeypatch.setenv("CANARY_DIR", str(canary))
    payload = pickle.dumps(Canary())
    switch(False)
    with pytest.raises(DecodeError):
        Decoder().decode(code_record(payload), [])
    assert not canary.exists(), "nothing received is unpickled without the switch"


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\x80\x05not a pickle", "malformed code record"),
        (b"", "malformed code record"),
        (pickle.dumps({"a": 1}), "must hold a function or a class, not a dict"),
        (pickle.dumps(42), "must hold a function or a class, not a int"),
    ],
)
def test_with_the_switch_a_malformed_or_unexpected_code_record_is_refused(switch, payload, why):
    switch(True)
    with pytest.raises(DecodeError, match=why):
        Decoder().decode(code_record(payload), [])


def test_with_the_switch_other_records_still_never_unpickle(switch, monkeypatch):
    switch(True)
    value = {"t": (1, 2), "s": "x", "n": [1.5, None, b"raw"]}
    blob = encoded(value)

    def no_unpickling(data: bytes) -> object:
        raise AssertionError("plain data was unpickled")

    monkeypatch.setattr(pickle, "loads", no_unpickling)
    assert Decoder().decode(blob, []) == value


def test_an_object_travels_pickled_only_with_the_switch(switch, tmp_path, monkeypatch):
    switch(False)
    with pytest.raises(EncodeError, match=r"cannot send a value of type builtins.object.*ACTORS_SEND_CODE=1"):
        encoded(object())
    switch(True)
    blob = encoded([Point(1, 2)])
    assert Decoder().decode(blob, []) == [Point(1, 2)]
    with pytest.raises(EncodeError, match=r"cannot pickle a _thread\.lock"):
        encoded(threading.Lock())  # pickle cannot take it: a codec refusal, not a crash
    port, receiver = actors.Channel.open(int)
    with pytest.raises(EncodeError, match="a Port inside a pickled Holder cannot travel"):
        encoded(Holder(port))  # a handle inside an object would bypass its own record: refused
    receiver.close()
    canary = tmp_path / "ran"
    monkeypatch.setenv("CANARY_DIR", str(canary))
    hostile = msgpack.packb(msgpack.ExtType(EXT_OBJECT, pickle.dumps(Canary())))
    switch(False)
    with pytest.raises(DecodeError, match=r"an object record .* does not let code travel"):
        Decoder().decode(hostile, [])
    assert not canary.exists()
    switch(True)
    with pytest.raises(DecodeError, match="cannot unpickle an object record"):
        Decoder().decode(msgpack.packb(msgpack.ExtType(EXT_OBJECT, b"\x80\x05junk")), [])


class Holder:
    """A plain class holding whatever it is given."""

    def __init__(self, value: object) -> None:
        self.value = value


class Point:
    """A plain class with no record of its own."""

    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)
