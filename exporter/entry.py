"""The ``gpu-exporter`` command's entry point: answers ``--version`` before importing the rest
(start-up time is a feature), then hands over to :func:`exporter.cli.main`."""

from __future__ import annotations

import sys

from exporter import __version__


def main() -> int:
    """Run the ``gpu-exporter`` command line."""
    if sys.argv[1:] == ["--version"]:
        print(f"gpu-exporter {__version__}")
        return 0
    from exporter.cli import main as cli_main

    return cli_main()
