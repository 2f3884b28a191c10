"""The ``nvfp4kv`` command (also ``python -m nvfp4kv``).

Subcommands:

- ``demo``  (the default): quantize a realistic K/V batch of Llama-3.1-8B geometry into a paged
  NVFP4 cache, read it back, print sizes, errors and store speed.
- ``plan``: how many tokens / sequences fit in a GPU memory budget, bf16 vs fp8 vs nvfp4.
- ``bench``: the GPU benchmark of the store and the gather (:mod:`nvfp4kv.bench`).
- ``info``: version, library file, build details, devices.

Every subcommand has ``--help`` and ``--json`` (machine-readable output on stdout). Bad
arguments exit with status 2, runtime errors with status 1, each with one line on stderr. Bad
arguments include values that only show as bad after parsing (weights larger than the memory, a
geometry KVCacheSpec rejects or whose NVFP4 page side no operation takes, a demo larger than the
machine's memory: :class:`UsageError`), and no argument makes the command compute for long before
it is rejected.
Progress goes to stderr, so stdout stays clean for tables and JSON. Set ``NVFP4KV_DEBUG=1``
(anything but empty or 0) to get the Python traceback of an error found after parsing, before its
line (the exit status stays). With stderr closed, or its reader gone, the error lines vanish and
the exit statuses stay.

Layout: this module has the parser and :func:`main`; each subcommand is a module (``demo``,
``plan``, ``bench``, ``info``) with its ``add_parser(sub, common)`` and its command function;
``_common`` has what they share (:class:`CLIError`, argument types, output helpers).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import List

from . import bench, demo, info, plan
from ._common import PROG, CLIError, UsageError, parse_size
from .demo import run_demo
from .info import collect_info
from .plan import plan_capacity

__all__ = [
    "CLIError",
    "UsageError",
    "build_parser",
    "collect_info",
    "main",
    "parse_size",
    "plan_capacity",
    "run_demo",
]


# ------------------------------------------------------------------------------ argument parsing
class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit status 2), and options only by
    their full names: an abbreviation that works today (--mem) would stop working, or mean another
    option, the day a second option shares its prefix."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # the subcommands' parsers are of this class too
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, _usage_line(self.prog, message))

    def _print_message(self, message, file=None):
        """argparse's, except that help or version text that stdout cannot take raises (argparse
        drops the error, so `--help > /dev/full` exited 0: review); main reports it. A line for
        stderr is still dropped where stderr cannot take it: the exit status says the rest."""
        if file is sys.stdout and message:
            file.write(message)
        else:
            super()._print_message(message, file)


def _usage_line(prog: str, message: str) -> str:
    """``<prog>: error: <message> (see '<prog> --help')``, on one line whatever the message."""
    message = _LINE_BREAKS.sub(" ", str(message))
    return f"{prog}: error: {message} (see '{prog} --help')\n"


def _attach_negative_values(argv: List[str], parser: argparse.ArgumentParser) -> List[str]:
    """`--memory -5GB` as `--memory=-5GB`: argparse takes a value that starts with "-" and is not a
    plain number for an option and says only "expected one argument"; attached, the option's own
    check names what is wrong with it (review). Not to an option that takes no value (`--json -5`
    was refused as "ignored explicit argument"; apart, -5 is an unrecognized argument: review)."""
    flags = _flag_options(parser)
    out: List[str] = []
    for a in argv:
        if out and re.fullmatch(r"--[a-z][a-z-]*", out[-1]) and out[-1] not in flags and re.fullmatch(r"-[0-9.].*", a):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def _flag_options(ap: argparse.ArgumentParser) -> frozenset:
    """The long options of `ap` and its subcommands that take no value (--json, --list-models, ...)."""
    parsers = [ap] + [p for a in ap._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()]
    return frozenset(o for p in parsers for a in p._actions if a.nargs == 0 for o in a.option_strings)


def _is_common(arg: str) -> bool:
    """An option every subcommand has: --json, -q, --quiet, or -q repeated (-qq)."""
    return arg in _COMMON or re.fullmatch(r"-q+", arg) is not None


# Whatever str.splitlines() splits on (an argument echoed in a message may hold any of these).
_LINE_BREAKS = re.compile(r"[ \t]*[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]+[ \t]*")


# ------------------------------------------------------------------------------------ parser, main
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``nvfp4kv`` command."""
    try:
        from .. import __version__ as version
    except ImportError:  # the extension is missing: still show --help
        version = "unknown"
    ap = _Parser(
        prog=PROG,
        description="NVFP4 paged KV cache: demo, capacity planner, benchmark, "
        "build info. Without a subcommand, runs 'demo'.",
        epilog="A subcommand's options follow it (nvfp4kv plan --memory 141GB); --json and -q "
        "may also come before it.",
    )
    ap.add_argument("--version", action="version", version=f"{PROG} {version}")
    sub = ap.add_subparsers(dest="command", metavar="{demo,plan,bench,info}")

    common = _Parser(add_help=False)
    for flags, help_text in _COMMON_OPTIONS:
        common.add_argument(*flags, action="store_true", help=help_text)
    for module in (demo, plan, bench, info):  # the order of --help
        module.add_parser(sub, common)
    return ap


_COMMANDS = ("demo", "plan", "bench", "info")
# The options every subcommand has (flags, help); main() also takes them before the subcommand.
_COMMON_OPTIONS = ((("--json",), "print machine-readable JSON on stdout"),
                   (("-q", "--quiet"), "no progress lines on stderr"))
_COMMON = tuple(flag for flags, _ in _COMMON_OPTIONS for flag in flags)


def _debug() -> bool:
    """NVFP4KV_DEBUG set to anything but "" or "0": errors print their traceback too."""
    return os.environ.get("NVFP4KV_DEBUG", "") not in ("", "0")


def _parses(argv: list[str]) -> bool:
    """Whether argv parses with nothing left over (its errors not printed)."""
    stderr, sys.stderr = sys.stderr, open(os.devnull, "w")
    try:
        return not build_parser().parse_known_args(argv)[1]
    except SystemExit:
        return False
    finally:
        sys.stderr.close()
        sys.stderr = stderr


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nvfp4kv`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # A "--" before a subcommand or at the end ends options that precede nothing positional: dropped
    # (`nvfp4kv -- plan`, `nvfp4kv --json -- plan`, `nvfp4kv plan --`; review).
    argv = [a for i, a in enumerate(argv) if a != "--" or (i + 1 < len(argv) and argv[i + 1] not in _COMMANDS)]
    if sys.stderr is None:  # started with stderr closed: its lines vanish, the exit statuses stay
        sys.stderr = open(os.devnull, "w")
    if sys.stdout is None:  # started with stdout closed: every print would vanish, exit 0 after all
        _say(f"{PROG}: error: stdout is closed; nowhere to print the results\n")
        return 1
    # --version before any subcommand answers alone, whatever else comes with it (`nvfp4kv --tokens
    # 16 --version`: argparse called 16 an invalid subcommand).
    if "--version" in argv[:next((i for i, a in enumerate(argv) if a in _COMMANDS), len(argv))]:
        argv = ["--version"]
    # No subcommand: demo, with the options given (`nvfp4kv --json` is `nvfp4kv demo --json`), and
    # its help where a demo option comes with --help (`nvfp4kv --tokens 16 --help`; review: argparse
    # called 16 an invalid subcommand). --help alone, or with the common options, is the command's.
    helps = ("-h", "--help", "--version")
    if not argv or (argv[0].startswith("-") and not any(a in _COMMANDS for a in argv) and (
            not any(a in helps for a in argv) or any(a.startswith("-") and a not in helps and not _is_common(a)
                                                     for a in argv))):
        argv = ["demo"] + argv
    parser = build_parser()  # one for the argument rewrites below and the parse
    argv = _attach_negative_values(argv, parser)
    # The options every subcommand has, given before it (`nvfp4kv --json plan`): after it.
    first = next((i for i, a in enumerate(argv) if a in _COMMANDS), 0)
    if first and all(_is_common(a) for a in argv[:first]):
        argv = argv[first:first + 1] + argv[:first] + argv[first + 1:]
    elif first and argv[0].startswith("-") and not any(a in ("-h", "--help", "--version") for a in argv[:first]):
        # `nvfp4kv --seed 5 demo`: argparse would call 5 an invalid subcommand. The command with
        # them moved is suggested only where that subcommand takes them (review: `--seed 5 plan`
        # suggested `plan --seed 5`, which plan refuses).
        given, command = " ".join(argv[:first]), argv[first]
        if _parses(argv[first:first + 1] + argv[:first]):
            _say(_usage_line(PROG, f"{given}: a subcommand's options go after it ({PROG} {command} {given})"))
        else:
            _say(_usage_line(f"{PROG} {command}", f"{given}: {command} does not take these options"))
        return 2
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as e:  # --help, --version (0) and usage errors (2)
        try:
            sys.stdout.flush()  # the help or version text, whose write may fail only here
        except OSError as err:
            return _stdout_failed(err)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except OSError as e:  # the help or version text not written (_Parser._print_message)
        return _stdout_failed(e)
    if extra:  # reported by the subcommand they were given to (argparse names the top level)
        _say(_usage_line(f"{PROG} {args.command}" if args.command else PROG,
                         f"unrecognized arguments: {' '.join(extra)}"))
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        _say(f"{PROG} {args.command}: interrupted\n")
        return 130
    except UsageError as e:  # a bad argument found after parsing: as argparse reports one
        _say_traceback()
        _say(_usage_line(f"{PROG} {args.command}", e))
        return 2
    except BrokenPipeError:  # e.g. `nvfp4kv plan | head -1`: stop quietly
        _quiet_stdout()
        return 0
    except Exception as e:  # any other: one line (review: a torch whose import raised AttributeError
        _say_traceback()    # printed a traceback)
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        if isinstance(e, MemoryError):
            msg = f"out of memory ({msg})" if msg else "out of memory"
        elif not isinstance(e, (CLIError, ValueError, TypeError, RuntimeError, OSError, ImportError, KeyError,
                                ArithmeticError)):  # not an error the commands expect: say its kind
            msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
        msg = " ".join(str(msg).split())  # one line
        _say(f"{PROG} {args.command}: error: {msg}\n")
        return 1


def _quiet_stdout() -> None:
    """After stdout failed (its reader gone, a full disk): Python flushes stdout at exit, which
    would raise again, so fd 1 points at /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _stdout_failed(error: OSError) -> int:
    """The exit status where the help or version text could not be written: a reader gone
    (`--help | head -1`) is no error (0); anything else (`--help > /dev/full`) exits 1 with its
    line, as a subcommand's output does (review: it exited 0 and said nothing)."""
    _quiet_stdout()  # text left in the buffer would fail again at exit (status 120)
    if isinstance(error, BrokenPipeError):
        return 0
    _say(f"{PROG}: error: {error}\n")
    return 1


def _say(text: str) -> None:
    """An error line on stderr, or nothing where nobody reads it any more (its pipe's reader gone):
    the exit status says the rest."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _say_traceback() -> None:
    """With NVFP4KV_DEBUG set, the traceback of the exception being handled, before its line: the
    exit status stays the one the line's kind has (2 for a bad argument, 1 otherwise)."""
    if _debug():
        import traceback

        _say(traceback.format_exc())
