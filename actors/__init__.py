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

The package is built in layers; a module imports only from its own layer and
those below (type-only imports aside), which ``lint-imports`` checks in CI::

    ray          Ray-placed host meshes                                  (public)
    _meshes      host, proc and actor meshes, accumulators, controllers, attached workers
    _processes   the forkserver (both sides), remote hosts' forkservers, lifelines, GPUs
    weights      manifests, publisher, consumer, inbox                   (public)
    _hosting     Actor, @endpoint, the actor server, the worker's entry
    tensors      weight transports: shm, cuda-ipc, tcp, local            (public)
    _runtime     a process's Runtime, calls, futures, ports, context, failures
    _transport   sockets, links, flow control, the inbox pump, peers
    _wire        the codec and the named records on the wire
    _shared      errors, names, liveness, session, segments, loops, config

This module defines nothing: it re-exports the public names.
"""

from ._hosting._actor import Actor, Endpoint, concurrent_endpoint, endpoint
from ._hosting._response_port import ResponsePort
from ._meshes._accumulator import Accumulator
from ._meshes._actor_mesh import ActorMesh, MeshEndpoint, Selection, send
from ._meshes._attached import attach_to_workers, hosts_from_config
from ._meshes._controllers import get_or_spawn_controller
from ._meshes._host_mesh import HostMesh, this_host, this_proc
from ._meshes._instance import Context, Instance, context, current_actor_name
from ._meshes._not_offered import ProcId, Uid, as_endpoint, attach, config, debug_controller, default_bootstrap_cmd
from ._meshes._proc_mesh import ProcMesh
from ._meshes._shutdown import shutdown_context
from ._meshes._worker_loop import run_worker_loop_forever, run_worker_loop_until_shutdown, start_worker_loop_forever
from ._processes._forkserver import forkserver_preload, set_forkserver_preload
from ._runtime._context import current_rank, current_size
from ._runtime._future import Future
from ._runtime._port import Channel, Port, PortReceiver
from ._runtime._returns_future import returns_future
from ._runtime._supervision import (
    Failure,
    MeshFailure,
    add_failure_handler,
    remove_failure_handler,
    unhandled_fault_hook,
)
from ._runtime._telemetry import get_meter, span, traced
from ._runtime._transport_choice import ChannelTransport, enable_transport
from ._runtime._value_mesh import Extent, Point, ValueMesh
from ._shared._errors import (
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
from ._shared._restart import RestartMode, RestartPolicy
from ._shared._session import bind_host, host_id, new_session_keys
from ._wire._code import allow_code
from .weights import (
    ReceivesWeights,
    WeightConsumer,
    WeightInbox,
    WeightManifest,
    WeightPublisher,
    available_transports,
    join_publish,
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
    "ChannelTransport",
    "ChecksumError",
    "CodecError",
    "Context",
    "DecodeError",
    "EncodeError",
    "Endpoint",
    "Extent",
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
    "ProcId",
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
    "Uid",
    "ValueMesh",
    "VersionError",
    "WeightConsumer",
    "WeightInbox",
    "WeightManifest",
    "WeightPublisher",
    "WeightSyncError",
    "add_failure_handler",
    "allow_code",
    "as_endpoint",
    "attach",
    "attach_to_workers",
    "available_transports",
    "bind_host",
    "concurrent_endpoint",
    "config",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
    "debug_controller",
    "default_bootstrap_cmd",
    "enable_transport",
    "endpoint",
    "forkserver_preload",
    "get_meter",
    "get_or_spawn_controller",
    "host_id",
    "hosts_from_config",
    "join_publish",
    "new_session_keys",
    "remove_failure_handler",
    "returns_future",
    "run_worker_loop_forever",
    "run_worker_loop_until_shutdown",
    "send",
    "set_forkserver_preload",
    "shutdown_context",
    "span",
    "start_worker_loop_forever",
    "this_host",
    "this_proc",
    "traced",
    "unhandled_fault_hook",
]
