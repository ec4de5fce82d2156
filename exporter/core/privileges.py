"""The Linux capabilities the agent runs with, and what it cannot do without the missing ones.

Read from the effective set in ``/proc/self/status`` (``CapEff``), so that a missing capability
is reported when the agent starts (a log line, ``check-config``, the ``gpu_exporter_capability``
metric) instead of being discovered as EPERM at the moment the reaper means to act.
"""

from __future__ import annotations

import os

#: The capabilities the zombie reaper may need, with their numbers (linux/capability.h).
CAPABILITIES = {
    "CAP_DAC_OVERRIDE": 1,
    "CAP_DAC_READ_SEARCH": 2,
    "CAP_KILL": 5,
    "CAP_SYS_PTRACE": 19,
}
#: Listing another user's /proc/PID/fd (0500) needs the first (or root's CAP_DAC_OVERRIDE),
#: reading its entries the second. Checked with setpriv on Linux 6.18.
READ_FDS = ("CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE")


def effective(status_path: str = "/proc/self/status") -> frozenset[str] | None:
    """The names of :data:`CAPABILITIES` in this process's effective set; None when unknown."""
    try:
        with open(status_path, encoding="ascii", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("CapEff:"):
            try:
                bits = int(line.split(":", 1)[1].strip(), 16)
            except ValueError:
                return None
            return frozenset(name for name, bit in CAPABILITIES.items() if bits >> bit & 1)
    return None


def reaper_warnings(dry_run: bool, caps: frozenset[str] | None) -> list[str]:
    """One line per thing the zombie reaper cannot do with ``caps`` (empty when unknown)."""
    if caps is None:
        return []
    lines = []
    if not dry_run and "CAP_KILL" not in caps:
        lines.append(
            "the zombie reaper may signal (dry_run: false) but the agent lacks CAP_KILL: it can "
            f"signal only processes of its own user (uid {os.geteuid()}); another user's orphan "
            "is skipped as signal_failed after an EPERM, recorded in the audit log. Grant "
            "CAP_KILL (docs/deploy.md) or set dry_run: true"
        )
    missing = [name for name in READ_FDS if name not in caps]
    if "CAP_DAC_OVERRIDE" in caps and "CAP_DAC_READ_SEARCH" in missing:
        missing.remove("CAP_DAC_READ_SEARCH")  # it allows listing the directory as well
    if missing:
        lines.append(
            f"the agent lacks {' and '.join(missing)}: other users' processes will be "
            "unverifiable for the zombie reaper (their /proc/PID/fd cannot be read), and so "
            f"never signalled; grant {' and '.join(READ_FDS)} (docs/deploy.md)"
        )
    return lines
