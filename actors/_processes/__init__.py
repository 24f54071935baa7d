"""Layer 7 — starting processes: the forkserver (both sides of its pipe) and GPUs per process.

Owns: ``_forkserver`` (the controller's side), ``_forkserver_process`` (the
forkserver itself), ``_devices`` (``CUDA_VISIBLE_DEVICES`` per process). May
import: the layers below (``weights`` included).
"""
