"""``python -m nvfp4kv.cli``: the same as ``python -m nvfp4kv``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
