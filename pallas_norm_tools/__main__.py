"""``python -m pallas_norm_tools``: the ``pallas-norm`` command line."""

import sys

from pallas_norm_tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
