"""Layer 1 — what crosses the wire: the codec (msgpack, tensors, handles) and the named record types.

Owns: ``_ext``, ``_refs``, ``_buffers``, ``_encoder``, ``_decoder``,
``_codec`` (the codec in one import) and ``_records`` (one named type per
kind of record, batch framing). May import: ``_shared``.
"""
