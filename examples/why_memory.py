"""Why is my memory not lower? Finding the policy that keeps too much (CPU, a few seconds).

A stack of MLP blocks runs in one region with ``policies.save_matmuls()``: keep matmul outputs,
recompute the rest. Someone also wanted the MLPs' matmuls kept and pushed an inner policy,
``keep_mlp``, that answers ``True`` (MUST_SAVE) for *every* op whose module path contains
"mlp". The step's peak barely moves compared with no checkpointing. The walkthrough:

1. ``measure()`` the step: peak and end-of-forward memory, with and without the region.
2. ``region.summary()``: the table shows most kept bytes "decided by keep_mlp", and the
   largest kept values are GELU outputs, not matmuls.
3. ``region.explain(gelu_output)``: kept because ``keep_mlp`` answered MUST_SAVE for
   ``aten.gelu``; recomputing it would cost one cheap op.
4. Fix the policy (answer only for matmuls, abstain otherwise), measure again, and explain the
   same value: now recomputed, from the kept matmul output.

Run:
    python examples/why_memory.py
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ckpt_graph as cg
from ckpt_graph import policies
from ckpt_graph.memory import measure, measure_with_result

aten = torch.ops.aten
MIB = 2**20


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class Model(nn.Module):
    def __init__(self, d: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))

    def forward(self, x: torch.Tensor, inner: Any = None) -> torch.Tensor:
        for block in self.blocks:
            if inner is None:
                x = block(x)
            else:
                with cg.save_recompute_policy(inner):  # pushed onto the same region
                    x = block(x)
        return x


def keep_mlp(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The culprit: meant "keep the MLP matmuls", but keeps everything inside the MLP."""
    return True if "mlp" in ctx.module_path else None


def keep_mlp_matmuls(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The fix: answer only for the MLP's matmuls; abstain (None) for everything else."""
    return True if "mlp" in ctx.module_path and op is aten.addmm.default else None


def step(model: Model, x: torch.Tensor, inner: Any, box: list[Any]) -> None:
    """Forward in one region (outer policy save_matmuls), then backward."""
    if inner == "eager":
        y = model(x)
    else:
        with cg.save_recompute_policy(policies.save_matmuls()) as region:
            y = model(x, inner)
        box.append(region)
    y.square().mean().backward()


def end_of_forward(model: Model, x: torch.Tensor, inner: Any) -> int:
    """Bytes still allocated by the forward when it returns, its output excluded."""

    def forward() -> torch.Tensor:
        with cg.save_recompute_policy(policies.save_matmuls()):
            return model(x, inner)

    y, report = measure_with_result(forward)
    return report.end_bytes - y.nbytes


def inspect(model: Model, x: torch.Tensor, inner: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The forward's region, the GELU output of the first block (to explain it), the output.

    The output is returned so that the autograd graph, and what the region holds for it,
    stays alive while we look at the region.
    """
    gelu: list[torch.Tensor] = []
    hook = model.blocks[0].mlp[1].register_forward_hook(lambda m, i, o: gelu.append(o))
    try:
        with cg.save_recompute_policy(policies.save_matmuls()) as region:
            y = model(x, inner)
    finally:
        hook.remove()
    return region, gelu[0], y


def main() -> None:
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(8, 128, 256, requires_grad=True)

    print("== 1. Measure the step (forward + backward) ==")
    peaks = {}
    for name, inner in (("no checkpointing", "eager"), ("save_matmuls + keep_mlp", keep_mlp)):
        peaks[name] = measure(step, model, x, inner, []).peak_bytes
        print(f"{name:<28} peak {peaks[name] / MIB:7.1f} MiB")
    worse = peaks["save_matmuls + keep_mlp"] >= peaks["no checkpointing"]
    print("Not lower at all!" if worse else "Hardly lower.", "What does the region keep?\n")

    print("== 2. region.summary() ==")
    kept = end_of_forward(model, x, keep_mlp)
    region, gelu, _y = inspect(model, x, keep_mlp)
    print(region.summary())
    print(f"(measured at the end of the forward: {kept / MIB:.1f} MiB still allocated)\n")

    print("== 3. region.explain() on the largest kept value: a GELU output ==")
    print(region.explain(gelu), "\n")

    print("== 4. Fix the policy: answer only for matmuls ==")
    kept_fixed = end_of_forward(model, x, keep_mlp_matmuls)
    region_fixed, gelu_fixed, _y_fixed = inspect(model, x, keep_mlp_matmuls)
    peak_fixed = measure(step, model, x, keep_mlp_matmuls, []).peak_bytes
    print(region_fixed.summary())
    print()
    print(region_fixed.explain(gelu_fixed), "\n")
    print(f"{'':<28} {'kept after forward':>18} {'step peak':>10}")
    print(
        f"{'keep_mlp':<28} {kept / MIB:14.1f} MiB {peaks['save_matmuls + keep_mlp'] / MIB:6.1f} MiB"
    )
    print(f"{'keep_mlp_matmuls':<28} {kept_fixed / MIB:14.1f} MiB {peak_fixed / MIB:6.1f} MiB")
    print(f"{'no checkpointing':<28} {'':>18} {peaks['no checkpointing'] / MIB:6.1f} MiB")


if __name__ == "__main__":
    main()
