"""Status lines on stderr for long work (the benchmarks and the ``nvfp4kv`` command)."""

import sys

__all__ = ["Progress"]


class Progress:
    """Status lines on stderr: rewritten in place on a terminal, one line each otherwise (a log
    or a CI job keeps every line, with no carriage returns)."""

    def __init__(self, prefix: str = "", enabled: bool = True):
        self.prefix = prefix
        self.enabled = enabled and sys.stderr is not None  # None: started with stderr closed
        self.tty = self.enabled and sys.stderr.isatty()

    def __call__(self, message: str):
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r\033[K" + self.prefix + message)
        else:
            sys.stderr.write(self.prefix + message + "\n")
        sys.stderr.flush()

    def done(self, message: str = ""):
        """Clears the status line; ``message``, if given, stays as a line of its own."""
        if self.tty:
            sys.stderr.write("\r\033[K")
        if not self.enabled:
            return
        if message:
            sys.stderr.write(self.prefix + message + "\n")
        sys.stderr.flush()
