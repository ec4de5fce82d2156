"""The terminal side of ``status``: whether to colour, colours that leave the text as it is,
and ``--watch``'s frames, redrawn in place on a terminal (printed one after another elsewhere)
until SIGINT or SIGTERM.

Only ANSI sequences every terminal emulator of the last decades reads (SGR colours, cursor home,
erase in line and below, cursor hide and show, DEC mode 25); no curses, no alternate screen:
the last frame stays on screen when the watch ends, with the cursor below it.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

RESET = "\x1b[0m"
#: The styles :func:`paint` knows (SGR parameters).
STYLES = {"green": "32", "yellow": "33", "red": "31", "dim": "2", "bold": "1"}
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def colour_wanted(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Whether to colour what goes to ``stream``: only a terminal, and neither ``NO_COLOR``
    (set and not empty, as no-color.org says) nor ``TERM=dumb``."""
    env = os.environ if environ is None else environ
    return _isatty(stream) and not env.get("NO_COLOR") and env.get("TERM") != "dumb"


def paint(text: str, style: str | None, on: bool = True) -> str:
    """``text`` in ``style`` (a key of :data:`STYLES`; None: as it is), attributes reset after
    it; unchanged when ``on`` is false. Pad ``text`` first: the sequences take no column."""
    if not on or style is None or not text:
        return text
    return f"\x1b[{STYLES[style]}m{text}{RESET}"


def plain(text: str) -> str:
    """``text`` without its escape sequences: what the terminal shows of it."""
    return _ESCAPE.sub("", text)


def cut(line: str, width: int) -> str:
    """``line`` cut to ``width`` columns on screen (escape sequences take none), attributes
    reset after a cut that leaves a sequence in."""
    kept: list[str] = []
    shown = pos = 0
    for match in [*_ESCAPE.finditer(line), None]:
        text = line[pos : match.start() if match else len(line)]
        if shown + len(text) > width:
            kept.append(text[: width - shown])
            return "".join(kept) + (RESET if pos else "")
        kept.append(text)
        shown += len(text)
        if match:
            kept.append(match.group())
            pos = match.end()
    return line


class Screen:
    """Frames on ``stream``. On a terminal each frame is drawn over the last from the top-left
    corner (cursor hidden, each line erased to its end, what is below the frame erased), cut to
    the window's width and height, so that nothing scrolls; elsewhere frames are printed one
    after another, a blank line between them, without a single escape sequence."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = _isatty(stream)
        self.frames = 0
        self._hidden = False

    def width(self) -> int | None:
        """Columns of the terminal (None: no terminal, or one that does not say)."""
        return self._size()[0]

    def _size(self) -> tuple[int | None, int | None]:
        if not self.tty:
            return None, None
        try:
            columns, rows = os.get_terminal_size(self.stream.fileno())
        except (OSError, ValueError):
            return None, None
        return columns or None, rows or None  # a terminal without a size says 0

    def draw(self, lines: list[str]) -> None:
        """Show ``lines`` as the next frame."""
        if not self.tty:
            self.stream.write(("\n" if self.frames else "") + "\n".join(lines) + "\n")
        else:
            columns, rows = self._size()
            if rows is not None and len(lines) > rows:
                more = len(lines) - rows + 1
                lines = [*lines[: rows - 1], f"... {more} more lines"]
            if columns is not None:  # not the last column: a line that fills it wraps on some
                lines = [cut(line, columns - 1) for line in lines]
            # no newline after the last line: on the window's last row it would scroll
            frame = HOME + (CLEAR_LINE + "\n").join(lines) + CLEAR_LINE + CLEAR_BELOW
            if not self._hidden:
                self._hidden = True
                frame = HIDE_CURSOR + frame
            self.stream.write(frame)
        self.frames += 1
        self.stream.flush()

    def restore(self) -> None:
        """Put the terminal back: attributes reset, the cursor shown, on the line below the
        last frame."""
        if self._hidden:
            self._hidden = False
            self.stream.write(RESET + SHOW_CURSOR + "\n")
            self.stream.flush()


class _Stop(BaseException):
    """SIGINT or SIGTERM during a watch (a BaseException, as KeyboardInterrupt: no ``except
    Exception`` in the code a frame runs may swallow it)."""


def watch(frame: Callable[[int | None], list[str]], interval: float, stream: TextIO) -> None:
    """Draw ``frame(width)`` (width: the terminal's columns, None when there is none) on
    ``stream`` every ``interval`` seconds until SIGINT or SIGTERM, then restore the terminal and
    return."""
    screen = Screen(stream)

    def stop(_signum: int, _frame: Any) -> None:
        for number in previous:  # a second Ctrl-C must not break the restore
            signal.signal(number, signal.SIG_IGN)
        raise _Stop

    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    for number in previous:
        signal.signal(number, stop)
    try:
        while True:
            started = time.monotonic()
            screen.draw(frame(screen.width()))
            time.sleep(max(0.0, started + interval - time.monotonic()))
    except _Stop:
        pass
    finally:
        screen.restore()
        for number, handler in previous.items():
            signal.signal(number, handler)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or no file
        return False
