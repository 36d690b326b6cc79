"""``python -m pallas_norm``: the ``pallas-norm`` command line of the cross-stack tools (``pallas_norm_tools``).

A launcher script, not a library module: ``import pallas_norm`` never loads it (the one import from this
package into the tools, declared as such in the import-linter contracts of pyproject.toml).
"""

import sys

from pallas_norm_tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
