"""Layer 8 — meshes and the API built on them: host, proc and actor meshes, accumulators, controllers.

Owns: ``_host_mesh`` (``this_host``), ``_proc_mesh`` (``ProcMesh``, the handle),
``_mesh_supervisor`` (its failures, fault and restarts), ``_proc_stop`` (its stop sequence),
``_actor_mesh`` (``ActorMesh``, ``send``), ``_accumulator``, ``_controllers``
(``get_or_spawn_controller``), ``_instance`` (``context()``, ``Instance``). May import: every layer below; imported by
``ray`` and the package's ``__init__``.
"""
