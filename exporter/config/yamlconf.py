"""Strict YAML reading for config and scenario files: every error names file, line, key and why.

Unknown keys are errors (a typo must not silently disable a setting), and so are duplicate keys,
which plain PyYAML would silently resolve to the last one.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_MISSING: Any = object()
_LONGEST = 1000  # characters of a key or a reason in an error message


class ConfigError(Exception):
    """A bad setting: ``where`` (file:line, flag or variable), ``key`` and why."""

    def __init__(self, where: str, key: str, why: str) -> None:
        if len(why) > _LONGEST:  # a megabyte value quoted back is no help in a log line
            why = why[: _LONGEST - 3] + "..."
        self.where, self.key, self.why = where, key[:_LONGEST], why
        super().__init__(f"{where}: {key}: {why}" if key else f"{where}: {why}")


class Document:
    """A parsed YAML file with the line of every key."""

    def __init__(self, path: str, data: Any, lines: dict[tuple[Any, ...], int]) -> None:
        self.path, self.data, self.lines = path, data, lines

    def where(self, keys: tuple[Any, ...]) -> str:
        """``file:line`` of the value at ``keys`` (or of its nearest parent)."""
        while keys and keys not in self.lines:
            keys = keys[:-1]
        return f"{self.path}:{self.lines.get(keys, 1)}"

    def root(self) -> Section:
        """The top-level mapping; an empty file is an empty mapping."""
        data = {} if self.data is None else self.data
        if not isinstance(data, dict):
            raise ConfigError(f"{self.path}:1", "", "the file must be a mapping of keys to values")
        return Section(self, (), data)


#: The largest config or scenario file read: real ones are a few KiB.
MAX_FILE_BYTES = 1024 * 1024
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def load_document(path: str) -> Document:
    """Read and parse ``path``; raises ConfigError for unreadable files and bad YAML."""
    try:
        text = read_text(path).replace("\r\n", "\n").replace("\r", "\n")  # as open() reads
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            path, "", f"cannot read: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    return parse_document(text, path)


def read_text(path: str, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file at ``path`` (links followed), of at most ``limit``
    bytes; raises ConfigError for anything else, OSError or UnicodeDecodeError when unreadable."""
    _check_regular(path, os.stat(path), limit)  # before opening: opening a device can act
    # O_NONBLOCK: a FIFO swapped in after the stat fails the check below instead of blocking
    # until a writer comes (forever, for a SIGHUP reload).
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _check_regular(path, os.fstat(fd), limit)
        data = _read_at_most(fd, limit + 1)  # it may have grown since
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ConfigError(path, "", f"is larger than {_mib(limit)}")
    return data.decode("utf-8")


def _check_regular(path: str, info: os.stat_result, limit: int) -> None:
    """Raise unless ``info`` is of a regular file of at most ``limit`` bytes."""
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _KINDS if test(info.st_mode)), "of an unknown kind")
        raise ConfigError(path, "", f"is not a regular file ({kind})")
    if info.st_size > limit:
        raise ConfigError(path, "", f"is larger than {_mib(limit)}")


def _read_at_most(fd: int, count: int) -> bytes:
    """Up to ``count`` bytes of ``fd``, fewer at its end."""
    chunks, left = [], count
    while left > 0:
        chunk = os.read(fd, min(left, 65536))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _mib(size: int) -> str:
    return f"{size / 1024**2:g} MiB"


def parse_document(text: str, path: str = "<string>") -> Document:
    """Parse YAML ``text`` (named ``path`` in errors)."""
    from exporter.config.yamlparse import parse_yaml  # PyYAML, only for commands that read YAML

    data, lines = parse_yaml(text, path)
    return Document(path, data, lines)


def dotted_key(keys: tuple[Any, ...]) -> str:
    out = ""
    for key in keys:
        name = str(key) if str(key).isprintable() else repr(key)  # one line, even for "a\nb"
        out += f"[{key}]" if isinstance(key, int) else (f".{name}" if out else name)
    return out


class Section:
    """One mapping of a Document being validated; :meth:`done` rejects keys nobody took."""

    def __init__(self, doc: Document, keys: tuple[Any, ...], data: dict[Any, Any]) -> None:
        self.doc, self.keys, self.data = doc, keys, data
        self._taken: set[Any] = set()

    def error(self, key: Any, why: str) -> ConfigError:
        """A ConfigError located at ``key`` of this section."""
        keys = (*self.keys, key) if key is not None else self.keys
        return ConfigError(self.doc.where(keys), dotted_key(keys), why)

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, parse: Callable[[Any], T], default: T = _MISSING) -> T:
        """Parse the value of ``key``; a ValueError from ``parse`` becomes a located error."""
        self._taken.add(key)
        if key not in self.data:
            if default is _MISSING:
                raise self.error(key, "is required")
            return default
        try:
            return parse(self.data[key])
        except ConfigError:
            raise
        except (ValueError, TypeError, ArithmeticError) as exc:
            raise self.error(key, str(exc)) from None

    def section(self, key: str, required: bool = False) -> Section:
        """The sub-mapping at ``key`` (an empty one when absent and not required)."""
        self._taken.add(key)
        value = self.data.get(key)
        if value is None:
            if required:
                raise self.error(key, "is required")
            return Section(self.doc, (*self.keys, key), {})
        if not isinstance(value, dict):
            raise self.error(key, f"must be a mapping, got {type(value).__name__}")
        return Section(self.doc, (*self.keys, key), value)

    def sections(self, key: str) -> list[Section]:
        """The list of mappings at ``key`` (empty when absent)."""
        self._taken.add(key)
        value = self.data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(key, f"must be a list, got {type(value).__name__}")
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise self.error(key, f"item {i} must be a mapping, got {type(item).__name__}")
            out.append(Section(self.doc, (*self.keys, key, i), item))
        return out

    def done(self) -> None:
        """Raise for the first key that no ``get``/``section`` call asked for."""
        for key in self.data:
            if key not in self._taken:
                known = ", ".join(sorted(map(str, self._taken))) or "none"
                raise self.error(key, f"unknown key (known here: {known})")
