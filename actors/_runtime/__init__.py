"""Layer 3 — one process's runtime and what rides on it: calls in flight, futures, ports, context, failures.

Owns: ``_core`` (``Runtime``, the composition root of a process; ``runtime()``),
``_parts`` (the typed per-process state of the layers above), ``_actor_host``
(what they use of a worker's actor server), ``_mesh_routes`` (failures and
deaths of spawned processes to their meshes), ``_pending_calls``,
``_call_sender``, ``_future``, ``_port``, ``_value_mesh``, ``_context`` (the
running actor's record), ``_supervision`` (failure records, handlers).
May import: ``_shared``, ``_wire``, ``_transport``.
"""
