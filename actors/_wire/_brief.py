"""A short account of an untrusted value, for an error message about it.

``repr`` of a malformed record is neither cheap nor bounded: a frame of
nested lists a thousand deep overflows the stack (``RecursionError`` past
the decode error's handling), and 500 MB of bytes make a 2 GB string before
any ``:.80`` cuts it. :func:`brief` looks at a few items of a few levels.
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["brief"]

#: Items shown per container, levels shown, characters shown per string and in all.
_ITEMS, _LEVELS, _TEXT, _TOTAL = 6, 2, 40, 120


def brief(value: Any) -> str:
    """``value`` in at most :data:`_TOTAL` characters, built from a bounded part of it."""
    text = _brief(value, 0)
    return text if len(text) <= _TOTAL else text[: _TOTAL - 1] + "…"


def _brief(value: Any, level: int) -> str:
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else "<int>"
    if isinstance(value, str):
        return repr(value[:_TEXT]) + ("…" if len(value) > _TEXT else "")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        if level >= _LEVELS:
            return "{…}" if value else "{}"
        pairs = itertools.islice(value.items(), _ITEMS)
        shown = [f"{_brief(key, level + 1)}: {_brief(item, level + 1)}" for key, item in pairs]
        return "{" + ", ".join(shown) + (", …" if len(value) > _ITEMS else "") + "}"
    if isinstance(value, (list, tuple)):
        opening, closing = ("[", "]") if isinstance(value, list) else ("(", ")")
        if level >= _LEVELS:
            return f"{opening}…{closing}" if value else opening + closing
        shown = [_brief(item, level + 1) for item in value[:_ITEMS]]
        return opening + ", ".join(shown) + (", …" if len(value) > _ITEMS else "") + closing
    return f"<{type(value).__name__}>"
