"""``python -m conveyor.cli``: the ``conveyor`` command."""

import sys

from conveyor.cli import main

if __name__ == "__main__":
    sys.exit(main())
