"""The msgpack codec of every process boundary (engine IPC, tensor-parallel step messages)."""

from __future__ import annotations

from typing import Any

import msgpack


def dumps(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def loads(raw: bytes) -> dict[str, Any]:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)
