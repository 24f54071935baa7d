"""Layer 7 — starting processes: the forkserver (both sides of its pipe) and GPUs per process.

Owns: ``_forkserver`` (the controller's side), ``_forkserver_process`` (the
forkserver itself), ``_forkserver_protocol`` (their pipe's messages),
``_node_forkserver`` (a host's forkserver driven by a remote controller),
``_lifeline`` (controller-to-host liveness over tcp), ``_devices``
(``CUDA_VISIBLE_DEVICES`` per process). May
import: the layers below (``weights`` included).
"""
