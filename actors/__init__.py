"""actors: a Monarch-style actor runtime on ZeroMQ, msgpack and asyncio.

Actors subclass :class:`Actor` and expose ``@endpoint`` methods; each lives in
its own process. ``this_host().spawn_procs(...)`` starts processes,
``ProcMesh.spawn`` places actors on them, and endpoints are invoked with
``call``, ``call_one``, ``choose``, ``broadcast`` or :func:`send`. Typed
:class:`Port` channels carry streams between actors. :mod:`actors.weights`
moves model weights between processes as versioned manifests over shared
memory or CUDA IPC.
"""

from ._actor import Actor, Endpoint, current_rank, current_size, endpoint
from ._actor_mesh import ActorMesh, MeshEndpoint, Selection, send
from ._errors import (
    ActorDied,
    ActorError,
    ActorsError,
    BufferFull,
    CallTimeout,
    ChecksumError,
    CodecError,
    DecodeError,
    EncodeError,
    LifecycleError,
    ManifestError,
    PortClosed,
    PublisherDied,
    SpawnError,
    StaleUpdateError,
    SupervisionError,
    TransportBlocked,
    VersionError,
    WeightSyncError,
)
from ._future import Future
from ._host_mesh import HostMesh, this_host
from ._port import Channel, Port, PortReceiver
from ._proc_mesh import ProcMesh
from ._restart import RestartMode, RestartPolicy
from ._supervision import Failure, add_failure_handler, remove_failure_handler, unhandled_fault_hook
from ._value_mesh import Point, ValueMesh
from .weights import (
    ReceivesWeights,
    WeightConsumer,
    WeightInbox,
    WeightManifest,
    WeightPublisher,
    available_transports,
)

__all__ = [
    "Actor",
    "ActorDied",
    "ActorError",
    "ActorMesh",
    "ActorsError",
    "BufferFull",
    "CallTimeout",
    "Channel",
    "ChecksumError",
    "CodecError",
    "DecodeError",
    "EncodeError",
    "Endpoint",
    "Failure",
    "Future",
    "HostMesh",
    "LifecycleError",
    "ManifestError",
    "MeshEndpoint",
    "Point",
    "Port",
    "PortClosed",
    "PortReceiver",
    "ProcMesh",
    "PublisherDied",
    "ReceivesWeights",
    "RestartMode",
    "RestartPolicy",
    "Selection",
    "SpawnError",
    "StaleUpdateError",
    "SupervisionError",
    "TransportBlocked",
    "ValueMesh",
    "VersionError",
    "WeightConsumer",
    "WeightInbox",
    "WeightManifest",
    "WeightPublisher",
    "WeightSyncError",
    "add_failure_handler",
    "available_transports",
    "current_rank",
    "current_size",
    "endpoint",
    "remove_failure_handler",
    "send",
    "this_host",
    "unhandled_fault_hook",
]
