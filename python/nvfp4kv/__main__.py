"""``python -m nvfp4kv``: the same as the ``nvfp4kv`` command (see :mod:`nvfp4kv.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
