"""``python -m ckpt_graph compare``: see :mod:`ckpt_graph.compare.cli`."""

from __future__ import annotations

import sys

from ckpt_graph.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
