"""``import ckpt_graph`` does not import torch's compiler stack.

A program that never compiles should not pay for inductor at import (about 900 modules) or
in every full garbage collection afterwards (the objects those modules keep alive). The
``torch.compile`` paths import what they need when they are used.
"""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_load_inductor() -> None:
    code = (
        "import sys, ckpt_graph\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._inductor'))[:5])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]", out.stdout
