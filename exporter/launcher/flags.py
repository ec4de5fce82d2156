"""The flags of ``recommend`` and ``run``: only argparse here, so that building the command
line parser (and ``gpu-exporter --version``) imports none of the launcher's machinery."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

#: The agent settings whose flags ``recommend`` and ``run`` take (``run --help`` lists no other).
USED_SETTINGS = frozenset({"config", "simulate", "paths.proc", "paths.locks"})
#: What ``recommend --format`` prints.
FORMATS = ("uuid", "index", "json", "env")
#: ``--restart-reset``'s default (``run.RESTART_RESET``, 600 s).
RESTART_RESET_DEFAULT = "10m"


def add_selection_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``recommend`` and ``run`` share."""
    parser.add_argument("--count", metavar="N", help="GPUs to choose (default: the policy's, 1)")
    parser.add_argument("--policy", metavar="NAME", default="default", help="recommend policy")
    parser.add_argument(
        "--min-free-memory", metavar="SIZE", help="at least this free (8GiB, 500MiB)"
    )
    parser.add_argument("--max-utilization", metavar="R", help="at most this busy (0.5 or 50%%)")
    parser.add_argument("--max-temperature", metavar="C", help="at most this hot (celsius)")
    parser.add_argument("--strategy", metavar="NAME", help="override the policy's strategy")
    parser.add_argument(
        "--exclusive", action="store_true", help="only GPUs with no process of any user on them"
    )
    parser.add_argument(
        "--mig",
        action="store_true",
        help="a MIG device with no process (of a GPU in MIG mode) instead of a whole GPU",
    )
    parser.add_argument(
        "--exclude-unhealthy",
        metavar="true|warning|false",
        help="leave out GPUs whose health verdict is critical (true, the default), warning or "
        "worse (warning), or none (false)",
    )
    parser.add_argument(
        "--from", dest="source", metavar="URL", help="let a running agent choose (its /recommend)"
    )


def add_fleet_flags(parser: argparse.ArgumentParser) -> None:
    """``recommend``'s flags for choosing across the hosts one Prometheus scrapes."""
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        help="choose the best host and GPUs of every fresh agent this Prometheus scrapes",
    )
    parser.add_argument(
        "--selector",
        metavar="{MATCHERS}",
        help='with --prometheus: only the targets these label matchers select: {cluster="a"}',
    )
    parser.add_argument(
        "--spread",
        action="store_true",
        help="with --prometheus: the GPUs may come from several hosts (default: one host)",
    )


# -- the parsers -----------------------------------------------------------------------------------


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser that keeps what was added to it, for help texts and tests to read:
    ``options`` (each option's Action by its longest flag) and ``commands`` (each subcommand's
    parser by name)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.options: dict[str, argparse.Action] = {}  # before super(): it adds --help
        self.commands: dict[str, CommandParser] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.option_strings:
            self.options[max(action.option_strings, key=len)] = action
        return action

    def add_subparsers(self, **kwargs: Any) -> Any:
        action = super().add_subparsers(**kwargs)
        self.commands = action.choices  # the mapping argparse fills as parsers are added
        return action


class SubcommandParser(CommandParser):
    """The parser of every subcommand (``add_subparsers(parser_class=...)``): it reports an
    unknown flag itself, under its own short usage (not the top level's), and reads ``-5s`` as a
    value for the validators to refuse in one line naming the flag, not as an unknown flag."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        args = sys.argv[1:] if args is None else args
        parsed, extras = super().parse_known_args(self._negatives_glued(args), namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def _negatives_glued(self, args: Sequence[str]) -> list[str]:
        """``--wait -5s`` as ``--wait=-5s``: argparse takes an argument that starts with "-" for
        a flag unless it is a negative number, and a negative duration or size is a value too.
        Only the flags' part is looked at: it ends at ``--`` or the first positional argument
        (``run``'s command)."""
        out = list(args)
        i = 0
        while i < len(out) and out[i] != "--" and out[i].startswith("-"):
            action = self.options.get(out[i])
            following = out[i + 1] if i + 1 < len(out) else None
            if action is None or following is None:
                i += 1
            elif action.nargs is None:  # exactly one value
                if _NEGATIVE.match(following):
                    out[i : i + 2] = [f"{out[i]}={following}"]
                    i += 1
                else:
                    i += 2
            elif action.nargs == "?" and not following.startswith("-"):  # --simulate FILE
                i += 2
            else:
                i += 1
        return out


#: What reads as a negative value, not a flag: "-5s", "-1", "-.5".
_NEGATIVE = re.compile(r"-\.?[0-9]")


def _subcommand(
    commands: Any,
    name: str,
    usage: str,
    help_text: str,
    add_settings: Callable[[argparse.ArgumentParser], None],
) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=help_text, usage=f"%(prog)s {usage}")
    add_settings(parser)
    add_selection_flags(parser)
    return parser


def add_parsers(commands: Any, add_settings: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``recommend`` and ``run`` to the subcommands."""
    recommend = _subcommand(
        commands,
        "recommend",
        "[FLAGS]",
        "print the GPUs to use (exit 75 when too few qualify)",
        add_settings,
    )
    recommend.add_argument(
        "--format",
        default="uuid",
        metavar="FORMAT",
        help=f"one of {', '.join(FORMATS)} (with --prometheus: uuid, INSTANCE UUID lines, or json)",
    )
    add_fleet_flags(recommend)
    run = _subcommand(
        commands,
        "run",
        "[FLAGS] -- CMD ARGS...",
        "lock GPUs and run a job on them: run [FLAGS] -- CMD",
        add_settings,
    )
    run.add_argument("--wait", metavar="DURATION", help="wait this long for GPUs (10m, or forever)")
    run.add_argument(
        "--restart", default="never", metavar="WHEN", help="never, on-failure or always"
    )
    run.add_argument(
        "--max-restarts", default="3", metavar="N", help="restarts at most (default 3; unlimited)"
    )
    run.add_argument(
        "--restart-reset",
        default=RESTART_RESET_DEFAULT,
        metavar="DURATION",
        help="an attempt that ran this long resets the restart count (default 10m, or never)",
    )
    run.add_argument("job", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
