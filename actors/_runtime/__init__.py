"""Layer 3 — one process's runtime and what rides on it: calls in flight, futures, ports, context, failures.

Owns: ``_core`` (``Runtime``, the composition root of a process; ``runtime()``),
``_pending_calls``, ``_call_sender``, ``_future``, ``_port``, ``_value_mesh``,
``_context`` (``context()``), ``_supervision`` (failure records, handlers).
May import: ``_shared``, ``_wire``, ``_transport``.
"""
