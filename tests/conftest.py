"""Pytest fixtures shared by the core-engine tests.

Helpers (``run``, ``check``, the model zoo, counting custom ops) live in ``tests/models.py`` so
that test modules can import them; this file only holds fixtures.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ckpt_graph import memory
from ckpt_graph.planner.cost_model import FLOPS_PER_BYTE_ENV

# Every memory_budget that is not given flops_per_byte= plans with this ratio instead of one
# calibrated on the machine, so no test result depends on the machine or its load (a
# calibrated 4.0 made a planner test fail on a clean clone). Set before any test runs, and
# inherited by the subprocesses tests start (the compare CLI). See Note [Pinned calibration].
PINNED_FLOPS_PER_BYTE = "2.0"
os.environ[FLOPS_PER_BYTE_ENV] = PINNED_FLOPS_PER_BYTE

# Test modules reuse a few helpers of other test modules (``from test_lifetime import
# gc_disabled``); pytest puts a test file's own folder on sys.path only when it collects it,
# so every folder of the mirror goes on it here, whatever subset is selected.
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if (
        _folder.is_dir()
        and not _folder.name.startswith(("_", "."))
        and str(_folder) not in sys.path
    ):
        sys.path.append(str(_folder))


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    """Reset the counting ops and check that no test leaves a region's machinery installed.

    A region that leaks its dispatch mode or saved-tensor hooks (e.g. after an exception inside
    the ``with`` block) would silently change every later test, so the leak fails this test.
    """
    # Only touch the zoo module if a test module imported it (keeps other suites independent).
    models = sys.modules.get("models")
    if models is not None:
        models.reset_counters()
    default_dtype = torch.get_default_dtype()
    grad_enabled = torch.is_grad_enabled()
    yield
    modes = _get_current_dispatch_mode_stack()
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    torch.set_default_dtype(default_dtype)
    torch.set_grad_enabled(grad_enabled)
    if models is not None:
        models.reset_counters()
    # A memory_budget's measured-step probe (Note [Measured budget check]) runs until its
    # policy's next step; a test that ends first must not leave a profiler collecting events
    # through every later test.
    memory._abandon_probes()
    assert not modes, f"dispatch modes left active after the test: {modes}"
    assert hooks is None, "saved-tensor hooks left installed after the test"


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run the test on one torch thread and restore the count after it.

    For tests of tiny ops on a busy machine, where OpenMP threads waiting for each other
    cost more than the work (up to 100x on the third-party zoo's tiny models). A module of
    such tests asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Reset torch.compile's caches and its counters before the test, and the caches after.

    For tests that count graph breaks, captures or compiled graphs: what an earlier test
    compiled is not counted, and what this one compiled is not reused by a later one.
    torch._dynamo is imported here, not at the top, so tests that never compile load none
    of it. A module of such tests asks for it with
    ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``.
    """
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
