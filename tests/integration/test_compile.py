"""torch.compile and regions: what compiles, what runs eagerly, and that gradients stay exact.

A region records aten ops with a TorchDispatchMode, which dynamo cannot trace: it skips every
frame while such a mode is active (torch/_dynamo/convert_frame.py). See Note [Wrapped modules
under torch.compile] in ckpt_graph/integrations/wrap.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import ckpt_graph as cg
from ckpt_graph.integrations.wrap import is_wrapped, wrap

BACKENDS = ["eager", "aot_eager"]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(torch.nn.Module):
    def __init__(self, loop: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(16, 1)
        self.loop = loop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        if self.loop:
            for b in self.blocks:
                h = b(h)
        else:
            h = self.blocks[1](self.blocks[0](h))
        return self.head(h)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _net(loop: bool = True) -> Net:
    torch.manual_seed(0)
    return Net(loop).double()


def _grads(model: torch.nn.Module, fn: object, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    fn(x).sum().backward()  # type: ignore[operator]
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


X = torch.randn(8, 16, dtype=torch.float64)


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_with_wrapped_blocks_warns(backend: str, loop: bool) -> None:
    """Wrapped blocks run eagerly; without a loop around them the rest is compiled.

    Dynamo cannot resume after a graph break inside a for loop: it then runs the whole
    forward eagerly ("graph break in loop"), which is what happens to most real models.
    """
    model = _net(loop)
    expected = _grads(model, model, X)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(wrap(model), backend=counter)
    with pytest.warns(
        UserWarning, match=r"Block\.forward \(wrapped by ckpt_graph\.wrap\) runs eagerly"
    ):
        got = _grads(model, compiled, X)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if not loop:
        assert counter.frame_count >= 2  # embed before the blocks, head after them
        assert counter.op_count >= 3
    frames = counter.frame_count
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(_grads(model, compiled, X), expected, rtol=0, atol=0)
    assert counter.frame_count == frames  # second step: no recompile


@pytest.mark.parametrize("backend", BACKENDS)
def test_region_inside_compiled_function_runs_eagerly(backend: str) -> None:
    model = _net()
    expected = _grads(model, model, X)

    counter = CompileCounterWithBackend(backend)

    @torch.compile(backend=counter)
    def f(x: torch.Tensor) -> torch.Tensor:
        with cg.save_recompute_policy("recompute_all"):
            return model(x)

    torch.testing.assert_close(_grads(model, f, X), expected, rtol=0, atol=0)
    # dynamo graph-breaks on the region's entry; nothing of the model is compiled
    assert sum(counters["graph_break"].values()) >= 1
    assert counter.op_count == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_module_inside_region_runs_eagerly(backend: str) -> None:
    model = _net()
    expected = _grads(model, model, X)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note about global module hooks (module paths)
        model.zero_grad(set_to_none=True)
        with cg.save_recompute_policy("recompute_all") as region:
            y = compiled(X)
        y.sum().backward()
    torch.testing.assert_close([p.grad for p in model.parameters()], expected, rtol=0, atol=0)
    # dynamo skipped the frame (a TorchDispatchMode is active): the region recorded the eager ops
    assert counter.frame_count == 0
    assert [n.op.__name__ for n in region.nodes].count("addmm.default") == 4


def test_wrap_after_compile_composes() -> None:
    """``wrap(torch.compile(model))`` finds the blocks through the OptimizedModule."""
    model = _net(loop=False)
    expected = _grads(model, model, X)
    counter = CompileCounterWithBackend("eager")
    compiled = wrap(torch.compile(model, backend=counter))
    assert all(is_wrapped(b) for b in model.blocks)
    with pytest.warns(UserWarning, match="runs eagerly under torch.compile"):
        torch.testing.assert_close(_grads(model, compiled, X), expected, rtol=0, atol=0)
    assert counter.frame_count >= 2
