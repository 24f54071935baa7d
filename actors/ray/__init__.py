"""Meshes that span machines, placed by Ray: ``actors.ray.host_mesh(...)`` in place of ``this_host()``.

Ray reserves the nodes and starts one actors host on each; every actor message
still goes over actors' own tcp sockets, CURVE-authenticated with the
session's keys (see ``docs/multihost.md``). Needs ``pip install 'actors[ray]'``.
"""

from ._ray_host_mesh import RayHostMesh, host_mesh, host_mesh_async

__all__ = ["RayHostMesh", "host_mesh", "host_mesh_async"]
