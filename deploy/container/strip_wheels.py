"""Strip the debug information from the shared objects inside wheels, in place.

    python deploy/container/strip_wheels.py WHEEL...

Some binary wheels ship their C extensions with full debug information: uvloop's loop module is
13.6 MB with it and 1.9 MB without, PyYAML's 2.7 MB and 0.4 MB. The image has no use for it, and
it would be most of the virtual environment, so build.sh strips every ``*.so`` member with
``strip --strip-debug`` (what is left still names its functions in a backtrace) and writes the
wheel again with the new sizes and hashes in its RECORD, as pip expects. A wheel without a shared
object, or whose objects have nothing to strip, is left as it is; a ``strip`` that fails (no
binutils, or a foreign machine's objects) leaves the member unchanged and says so.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _strip(data: bytes, name: str, strip: str) -> bytes:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "member.so"
        path.write_bytes(data)
        run = subprocess.run([strip, "--strip-debug", str(path)], capture_output=True, text=True)
        if run.returncode != 0:
            print(f"strip_wheels: {name} left as it is: {run.stderr.strip()}", file=sys.stderr)
            return data
        return path.read_bytes()


def strip_wheel(wheel: Path, strip: str = "strip") -> int:
    """Strip the shared objects of ``wheel`` in place; the bytes saved (0: file untouched)."""
    with zipfile.ZipFile(wheel) as source:
        members = [(info, source.read(info)) for info in source.infolist()]
    new: dict[str, bytes] = {}
    for info, data in members:
        if info.filename.endswith(".so") or ".so." in info.filename:
            stripped = _strip(data, f"{wheel.name}:{info.filename}", strip)
            if len(stripped) < len(data):
                new[info.filename] = stripped
    if not new:
        return 0
    record_name = next(
        info.filename for info, _ in members if info.filename.endswith(".dist-info/RECORD")
    )
    saved = 0
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for info, data in members:
            if info.filename == record_name:
                data = _record(data, new)
            elif info.filename in new:
                saved += len(data) - len(new[info.filename])
                data = new[info.filename]
            target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    partial = wheel.with_name(wheel.name + ".part")
    partial.write_bytes(out.getvalue())
    os.replace(partial, wheel)
    return saved


def _record(text: bytes, new: dict[str, bytes]) -> bytes:
    rows = list(csv.reader(io.StringIO(text.decode())))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        if row and row[0] in new:
            row = [row[0], _record_hash(new[row[0]]), str(len(new[row[0]]))]
        writer.writerow(row)
    return out.getvalue().encode()


def main(argv: list[str]) -> int:
    strip = shutil.which("strip")
    if strip is None:
        print("strip_wheels: no strip (binutils): wheels left as they are", file=sys.stderr)
        return 0
    for name in argv:
        saved = strip_wheel(Path(name), strip)
        if saved:
            print(f"strip_wheels: {Path(name).name}: {saved:,} bytes of debug information")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
