"""Status lines on stderr for long work (the benchmarks and the ``nvfp4kv`` command)."""

import os
import sys

__all__ = ["Progress"]


class Progress:
    """Status lines on stderr: rewritten in place on a terminal, one line each otherwise (a log
    or a CI job keeps every line, with no carriage returns; so does a terminal whose TERM is
    "dumb", which has no erase-line control)."""

    def __init__(self, prefix: str = "", enabled: bool = True):
        self.prefix = prefix
        self.enabled = enabled and sys.stderr is not None  # None: started with stderr closed
        self.tty = self.enabled and sys.stderr.isatty() and os.environ.get("TERM") != "dumb"

    def __call__(self, message: str):
        if not self.enabled:
            return
        self._write("\r\033[K" + self.prefix + message if self.tty else self.prefix + message + "\n")

    def done(self, message: str = ""):
        """Clears the status line; ``message``, if given, stays as a line of its own."""
        if self.tty and self.enabled:
            self._write("\r\033[K")
        if self.enabled and message:
            self._write(self.prefix + message + "\n")

    def _write(self, text: str) -> None:
        # Progress is for whoever reads stderr: where nobody does any more (its pipe's reader
        # gone), the work goes on without it instead of failing (review: a demo piped as
        # `2>&1 >out | head -1` stopped at its first line and exited 0 with out empty).
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (OSError, ValueError):
            self.enabled = False
