"""Code that travels: functions, lambdas, classes and other objects sent with cloudpickle, only in a session that opts in.

By default no received byte is ever unpickled: a function given as an
argument is refused at the sender with ``EncodeError``, and a code record
that arrives anyway is refused at the receiver with ``DecodeError``.

A session opts in with ``ACTORS_SEND_CODE=1`` in the controller's
environment before it spawns anything (or :func:`allow_code` called first):
every process it spawns inherits the setting. Then a function, lambda,
closure or class that is not plain data travels as one dedicated record
(``EXT_CODE``, a cloudpickle payload), and so does an object of a type the
codec has no record for (``EXT_OBJECT``: unpickling it runs its class's
code, which the session already accepts); every other record (plain
values, tensors, dataclasses, handles) is decoded as before and never
unpickled. A process that did not opt in refuses both records whatever its
peers do.

Trust model: every peer of a session holds its key (CURVE on tcp; the
0700 session directory on ipc), and any peer can already make any process
of the session run code, by spawning an actor there. Letting code travel
adds no new principal, but it makes every message that carries an argument
a way to run code: a leaked session key then means arbitrary code
execution through any endpoint, not only through spawns. Keep it off for
sessions that talk to processes you do not control.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import types
from typing import Any

from .._shared._errors import DecodeError, EncodeError
from ._ext import handle_of_type

__all__ = [
    "CODE_ENV",
    "allow_code",
    "code_allowed",
    "is_code",
    "pickle_code",
    "pickle_object",
    "refusal",
    "unpickle_code",
    "unpickle_object",
]

#: ``1``: this session lets functions, lambdas and classes travel (set before spawning; inherited).
CODE_ENV = "ACTORS_SEND_CODE"
_HOW = f"set {CODE_ENV}=1 in the controller's environment before it spawns (or call actors.allow_code() first)"


#: What counts as code: these travel as code records (other objects, callable or not, travel as data or not at all).
_CODE_TYPES = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    functools.partial,
    type,
)


def is_code(obj: Any) -> bool:
    """Whether ``obj`` is a function, lambda, closure, method, ``functools.partial`` or class."""
    return isinstance(obj, _CODE_TYPES)


def code_allowed() -> bool:
    """Whether this process sends and accepts code records."""
    return os.environ.get(CODE_ENV) == "1"


def allow_code() -> None:
    """Let code travel in this session: call it before spawning (processes spawned earlier keep refusing code)."""
    os.environ[CODE_ENV] = "1"


def _cloudpickle() -> Any:
    try:
        import cloudpickle
    except ImportError:
        raise EncodeError("sending code needs cloudpickle: pip install 'actors[code]'") from None
    return cloudpickle


def pickle_code(obj: Any) -> bytes:
    """``obj`` (a function, lambda, closure or class) as a cloudpickle payload."""
    cloudpickle = _cloudpickle()
    try:
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  # type: ignore[no-any-return]
    except Exception as exc:
        raise EncodeError(f"cannot pickle {getattr(obj, '__qualname__', obj)!r}: {exc}") from None


def pickle_object(obj: Any) -> bytes:
    """``obj`` (an object the codec has no record for) as a cloudpickle payload.

    An object that pickle cannot take (a lock, a socket), or that holds a
    port or a mesh (those travel only in records of their own), raises
    ``EncodeError``; any other exception raised by the object's own
    pickling code (``__getstate__``, ``__reduce__``) reaches the sender
    unchanged, as ``pickle.dumps`` would raise it.
    """
    cloudpickle = _cloudpickle()

    class Pickler(cloudpickle.CloudPickler):  # type: ignore[misc,name-defined]
        def reducer_override(self, value: Any) -> Any:
            if handle_of_type(type(value)) is not None:  # a port or mesh: only its own record may carry it
                raise EncodeError(
                    f"a {type(value).__name__} inside a pickled {type(obj).__qualname__} cannot travel: "
                    "send it as an argument of its own, or in a dataclass"
                )
            return super().reducer_override(value)

    buffer = io.BytesIO()
    try:
        Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        cls = type(obj)
        raise EncodeError(f"cannot pickle a {cls.__module__}.{cls.__qualname__}: {exc}") from None
    return buffer.getvalue()


def _refuse_unless_allowed(what: str) -> None:
    if not code_allowed():
        raise DecodeError(
            f"{what} arrived, but this process does not let code travel: {_HOW}; until then nothing received "
            "is unpickled"
        )


def unpickle_object(data: bytes) -> Any:
    """The object an object record holds; refused unless this process opted in.

    An exception raised while loading it (the class's ``__setstate__``, a
    missing module) becomes ``DecodeError`` naming it.
    """
    _refuse_unless_allowed("an object record (a pickled object)")
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise DecodeError(f"cannot unpickle an object record: {type(exc).__name__}: {exc}") from None


def unpickle_code(data: bytes) -> Any:
    """The function or class a code record holds; refused unless this process opted in."""
    _refuse_unless_allowed("a code record (a pickled function or class)")
    try:
        obj = pickle.loads(data)
    except Exception as exc:
        raise DecodeError(f"malformed code record: {type(exc).__name__}: {exc}") from None
    if not callable(obj):
        raise DecodeError(f"a code record must hold a function or a class, not a {type(obj).__name__}")
    return obj


def refusal(obj: Any) -> EncodeError:
    """Why ``obj`` (code) cannot be sent in a session that did not opt in."""
    return EncodeError(
        f"cannot send {getattr(obj, '__qualname__', obj)!r}: code does not travel by default, because that needs "
        "pickle, which actors runs on received bytes only in a session that opted in (it executes arbitrary code). "
        "Send data instead (define the behaviour as an endpoint of the receiving actor and send its arguments, or "
        f"a name the receiver looks up), or, if every process of the session is trusted, {_HOW}"
    )
