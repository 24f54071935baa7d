"""Layer 2 — moving records between processes: sockets, links, flow control, the inbox pump, the peer registry.

Owns: ``_sockets`` (ZeroMQ), ``_outbox``, ``_flow``, ``_receivers``,
``_inbox_pump``, ``_registry`` (peers, pids, deaths), ``_driver`` (the loop a
runtime is bound to, or a synchronous pump), ``_peer_news`` (deaths and
restarts passed on between hosts). May import: ``_shared``, ``_wire``.
"""
