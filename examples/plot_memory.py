"""Measure a training step with and without ckpt_graph and plot both timelines.

Run: python examples/plot_memory.py [output-directory]   (plots need matplotlib: `pip install -e ".[viz]"`)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import ckpt_graph as cg
from ckpt_graph.memory import MemoryReport, measure


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU()) for _ in range(8)]
    return torch.nn.Sequential(*layers)


def step(model: torch.nn.Module, x: torch.Tensor, policy: str | None) -> None:
    if policy is None:
        y = model(x)
    else:
        with cg.save_recompute_policy(policy=policy):
            y = model(x)
    y.square().mean().backward()


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    model, x = make_model(), torch.randn(4096, 128)
    reports: dict[str, MemoryReport] = {}
    for policy in (None, "recompute_all"):
        model.zero_grad(set_to_none=True)
        reports[policy or "no_checkpointing"] = measure(step, model, x, policy)
    for name, report in reports.items():
        print(f"== {name}\n{report}\n")
        try:
            report.plot(out_dir / f"memory_{name}.png")
        except ImportError as e:
            print(e)
            break


if __name__ == "__main__":
    main()
