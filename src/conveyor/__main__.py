"""``python -m conveyor``: the ``conveyor`` command (for an environment whose scripts folder is not on the PATH)."""

import sys

from conveyor.cli import main

if __name__ == "__main__":
    sys.exit(main())
