"""Layer 5 — hosting actors in a worker: the user's ``Actor`` class, the server that runs its calls, the worker's entry.

Owns: ``_actor`` (``Actor``, ``@endpoint``), ``_server`` (``ActorServer``,
which puts together ``_slots``, ``_dispatch``, ``_lifecycle``,
``_child_supervision`` and ``_failure_reports``), ``_invocation`` (one
received call), ``_response_port`` (an explicit reply port), ``_worker`` (the
actor process's entry point). May import: the layers
below and ``tensors``.
"""
