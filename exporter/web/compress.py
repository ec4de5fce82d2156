"""gzip for ``/metrics``, where most of the body is the same bytes from scrape to scrape.

A body is a few parts: the exposition rendered once per sample, the actions' rendered after each
run, and a tail of lines that change every scrape (the Snapshot's age, the HTTP counters). Each
unchanged part is deflated once and kept: it ends with a full flush (byte-aligned, no reference
to what came before), so deflate data made separately can follow it. A scrape then deflates only
its tail and writes one ordinary gzip member: the kept pieces, the tail, the CRC-32 (carried on
from the kept parts') and the length.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Sequence

#: gzip's fixed header: deflate, no flags, no time, no extra flags, OS unknown (RFC 1952).
_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
LEVEL = 1


class _Kept:
    """The deflated pieces of some parts, with their CRC-32 and length."""

    def __init__(self, parts: Sequence[bytes]) -> None:
        self.parts = tuple(parts)  # held: the cache is keyed by these objects' identities
        compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, -15)
        pieces, crc = [], 0
        for part in parts:
            pieces.append(compressor.compress(part))
            pieces.append(compressor.flush(zlib.Z_FULL_FLUSH))
            crc = zlib.crc32(part, crc)
        self.deflated = b"".join(pieces)
        self.crc = crc
        self.length = sum(map(len, parts))

    def matches(self, parts: Sequence[bytes]) -> bool:
        return len(parts) == len(self.parts) and all(
            a is b for a, b in zip(parts, self.parts, strict=True)
        )


class GzipCache:
    """gzip members of ``kept parts + tail`` bodies; the kept parts' deflate data is reused while
    they are the same objects. One per kind of body (text, OpenMetrics); thread-safe."""

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self._lock = threading.Lock()

    def compress(self, kept: Sequence[bytes], tail: bytes) -> list[bytes]:
        """The gzip member of ``b"".join(kept) + tail``, as pieces to send in order."""
        cached = self._kept
        if cached is None or not cached.matches(kept):
            with self._lock:
                cached = self._kept
                if cached is None or not cached.matches(kept):
                    cached = self._kept = _Kept(kept)
        # A small window and little memory: a tail is a few KiB, and a compressor is made per
        # scrape (the default one costs ~90 us to set up, this one ~10 us).
        compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, -10, 1)
        end = compressor.compress(tail) + compressor.flush(zlib.Z_FINISH)
        trailer = struct.pack(
            "<II", zlib.crc32(tail, cached.crc), (cached.length + len(tail)) & 0xFFFFFFFF
        )
        return [_HEADER, cached.deflated, end, trailer]
