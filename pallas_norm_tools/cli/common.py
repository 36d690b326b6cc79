"""What the ``pallas-norm`` commands share: the console, dtype names, and the check for optional extras."""

from __future__ import annotations

import importlib.util
import sys

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32",
          "float32": "float32"}


class MissingExtra(Exception):
    """A command needs a package that is not installed; the message names the ``pip install`` that brings it."""


def require(command: str, needs: dict[str, str]) -> None:
    """Find each module of ``needs`` (module -> the pallas-norm extra that installs it), or raise
    ``MissingExtra`` naming what ``command`` lacks and the one ``pip install`` line for all of it. Modules are
    found, not imported: importing triton here would fix its interpreter setting (``TRITON_INTERPRET``, read at
    import) before ``check`` sets it for a CPU run."""
    missing = {module: extra for module, extra in needs.items() if importlib.util.find_spec(module) is None}
    if missing:
        extras = ",".join(sorted(set(missing.values())))
        raise MissingExtra(f"pallas-norm {command} needs {', '.join(missing)}, which are not installed: "
                           f"pip install 'pallas-norm[{extras}]'")


def console():
    """A rich Console; 160 columns wide when writing to a file or pipe, so tables do not wrap in logs."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=160)


def fail(message: str) -> int:
    """Print ``message`` to stderr and return the usage-error exit code 2."""
    print(message, file=sys.stderr)
    return 2
