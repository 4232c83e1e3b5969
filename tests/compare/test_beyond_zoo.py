"""The models beyond the zoo (``compare.beyond_zoo``) build, and train exactly under ckpt_graph.

At their tiny sizes, with dropout 0.1 where the model has dropout: one region with
``recompute_all`` over the forward against the same step without checkpointing, bitwise
(float32 CPU kernels are deterministic; dropout masks and the VAE's sampled latent are
replayed), with the RNG stream left where eager leaves it. Skipped, with the reason, where
the model's library is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_zoo_third_party import step_workload

from ckpt_graph.compare import beyond_zoo
from ckpt_graph.compare.zoo import EXTRA, MODELS, THIRD_PARTY, Workload, build_workload

pytestmark = pytest.mark.usefixtures("one_thread")


def _workload(name: str) -> Workload:
    library = beyond_zoo.SPECS[name].library
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{name} needs the {library!r} package, which is not installed")
    torch.manual_seed(0)
    return build_workload(name, **beyond_zoo.TINY_SIZES[name], dropout=0.1)  # type: ignore[arg-type]


def test_extra_models_are_outside_the_zoo() -> None:
    # The zoo's benchmark (its default run) does not change; the CLI knows the extra models.
    assert len(EXTRA) >= 5 and not set(EXTRA) & set(THIRD_PARTY)
    assert set(EXTRA) <= set(MODELS)
    assert set(beyond_zoo.TINY_SIZES) == set(EXTRA)


@pytest.mark.parametrize("name", EXTRA)
def test_extra_model_builds_and_recompute_all_is_exact(name: str) -> None:
    w = _workload(name)
    assert len(w.blocks) >= 2
    initial = {k: v.clone() for k, v in w.model.state_dict().items()}
    ref = step_workload(w, initial, None)
    got = step_workload(w, initial, "recompute_all")
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=0, atol=0)
    assert all(g is not None for g in ref["grads"].values()), "every parameter is trained"
    for n, g in ref["grads"].items():
        torch.testing.assert_close(
            got["grads"][n], g, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}"
        )
    torch.testing.assert_close(got["rng"], ref["rng"], rtol=0, atol=0)


def test_extra_model_default_sizes_pass_the_cli_memory_check() -> None:
    from ckpt_graph.compare.zoo import DEFAULTS, estimate_bytes

    for name in EXTRA:
        d = DEFAULTS[name]
        need = estimate_bytes(name, d.layers, d.width, d.batch, d.seq_len)
        assert 0 < need < 2**30, f"{name}: {need / 2**20:.0f} MiB estimated"
