"""The memory node command, ``umbp-ucx-serve``, as the package installs it: a console script of
that name (and ``python -m umbp.memory_node``) that runs the same command as the Rust binary of
crate umbp-memory-node, compiled into this package, so a memory node needs no Rust toolchain.

``umbp-ucx-serve --help`` lists every flag; docs/MEMORY-NODE.md runs a node, as a service and
in a pool. The process becomes the memory node: it serves until SIGTERM or SIGINT, drains, and
exits with the command's status (0 after a drain, 1 when serving failed, 2 for bad flags).
"""

from __future__ import annotations

import signal
import sys
from typing import List, Optional

from . import _native

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Runs ``umbp-ucx-serve`` with ``argv`` (default: this process's ``sys.argv``, the
    program's name first) and returns its exit status."""
    # The command's own handlers take SIGINT, as in the binary: Python's would turn the first
    # Ctrl-C into a KeyboardInterrupt after the drain instead of the command's status.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return int(_native.serve_memory_node(list(sys.argv if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
