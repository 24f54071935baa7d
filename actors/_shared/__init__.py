"""Layer 0 — what every layer shares: the exception tree, names, process liveness, the session, spawn config.

Owns: ``_errors`` (the one exception tree, drawn in its docstring), ``_names``
(actor names on the wire), ``_liveness`` (pidfd watches), ``_session`` (the
runtime directory, addresses, CURVE keys), ``_segments`` (shared-memory
segment names and their removal), ``_config`` (what a new worker is told),
``_restart`` (restart policies), ``_hooks`` (named, typed event hooks), ``_main_loader`` (a script's definitions in
a worker). May import: nothing of ``actors``.
"""
