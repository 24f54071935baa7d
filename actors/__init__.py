"""actors: a Monarch-style actor runtime on ZeroMQ, msgpack and asyncio.

Actors subclass :class:`Actor` and expose ``@endpoint`` methods; each lives in
its own process. ``this_host().spawn_procs(...)`` starts processes,
``ProcMesh.spawn`` places actors on them, and endpoints are invoked with
``call``, ``call_one``, ``choose``, ``broadcast`` or :func:`send`. Typed
:class:`Port` channels carry streams between actors. :mod:`actors.weights`
moves model weights between processes as versioned manifests over shared
memory or CUDA IPC.

Programs written for Monarch's ``monarch.actor`` run with only their imports
changed; ``docs/monarch.md`` lists Monarch's API name by name, with every
difference and its reason.
"""

from ._accumulator import Accumulator
from ._actor import Actor, Endpoint, concurrent_endpoint, endpoint
from ._actor_mesh import ActorMesh, MeshEndpoint, Selection, send
from ._context import Context, Instance, context, current_actor_name, current_rank, current_size
from ._controllers import get_or_spawn_controller
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
    MainLoadingError,
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
from ._host_mesh import HostMesh, attach_to_workers, this_host, this_proc
from ._port import Channel, Port, PortReceiver
from ._proc_mesh import ProcMesh
from ._response_port import ResponsePort
from ._restart import RestartMode, RestartPolicy
from ._session import host_id
from ._supervision import Failure, MeshFailure, add_failure_handler, remove_failure_handler, unhandled_fault_hook
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
    "Accumulator",
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
    "Context",
    "DecodeError",
    "EncodeError",
    "Endpoint",
    "Failure",
    "Future",
    "HostMesh",
    "Instance",
    "LifecycleError",
    "MainLoadingError",
    "ManifestError",
    "MeshEndpoint",
    "MeshFailure",
    "Point",
    "Port",
    "PortClosed",
    "PortReceiver",
    "ProcMesh",
    "PublisherDied",
    "ReceivesWeights",
    "ResponsePort",
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
    "attach_to_workers",
    "available_transports",
    "concurrent_endpoint",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
    "endpoint",
    "get_or_spawn_controller",
    "host_id",
    "remove_failure_handler",
    "send",
    "this_host",
    "this_proc",
    "unhandled_fault_hook",
]
