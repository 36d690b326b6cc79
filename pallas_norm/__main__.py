"""``python -m pallas_norm``: the ``pallas-norm`` command line (check, bench, train)."""

import sys

from pallas_norm.cli import main

if __name__ == "__main__":
    sys.exit(main())
