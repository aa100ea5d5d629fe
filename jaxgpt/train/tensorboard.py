"""TensorBoard event files beside metrics.jsonl (``jaxgpt train --log tensorboard``), written here.

Why not tensorboardX: it imports torch whenever torch is installed, and jaxgpt never imports torch
(parity_tests/unit/test_imports.py). Scalars need little: a TFRecord file (length, masked CRC-32C of
the length, the bytes, their masked CRC-32C) of ``Event`` protos (wall_time = 1, step = 2,
file_version = 3, summary = 5; ``Summary.value`` = 1 with ``tag`` = 1, ``simple_value`` = 2),
encoded by hand below. The test reads the files back with tensorboardX's own protos and CRC.
"""
from __future__ import annotations

import math
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, wire: int) -> bytes:
    return _varint(num << 3 | wire)


def _bytes(num: int, data: bytes) -> bytes:
    return _field(num, 2) + _varint(len(data)) + data


def _event(wall_time: float, step: int = 0, *, file_version: str | None = None, scalars: dict | None = None) -> bytes:
    msg = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version is not None:
        msg += _bytes(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes(1, _bytes(1, tag.encode()) + _field(2, 5) + struct.pack("<f", v))
                          for tag, v in scalars.items())
        msg += _bytes(5, values)
    return msg


class TensorBoardLog:
    """Appends rows (dicts with 'step' and numeric values) to ``directory``'s event file:
    ``loss``, ``val_loss``, ... become scalars ``train/loss``, ``val/val_loss``, ..."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.jaxgpt"
        self._f = open(self.path, "ab")
        self._write(_event(time.time(), file_version="brain.Event:2"))

    def _write(self, msg: bytes) -> None:
        head = struct.pack("<Q", len(msg))
        self._f.write(head + struct.pack("<I", _masked(head)) + msg + struct.pack("<I", _masked(msg)))

    def __call__(self, rows: list[dict]) -> None:
        for r in rows:
            group = "val" if any(k.startswith("val_") for k in r) else "train"
            scalars = {f"{group}/{k}": float(v) for k, v in r.items()
                       if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
            if scalars:
                self._write(_event(time.time(), int(r["step"]), scalars=scalars))
        self._f.flush()

    def close(self) -> None:
        self._f.close()


__all__ = ["TensorBoardLog", "crc32c"]
