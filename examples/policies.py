"""Tour of the built-in policies on a small GPT-style model (CPU, a few seconds).

For each policy the script runs forward + backward once inside one region over the whole
model and prints the MiB kept at the end of the forward, the measured peak memory of the
step (and its ratio to the step without checkpointing), how many ops backward recomputed (and
that count over the forward's ops), and the largest gradient difference from a run without
checkpointing (0 for every policy: recompute replays the forward's ops exactly).

Reading the table (measured: 8 blocks, 255 forward ops, 16.8 MiB peak without checkpointing):

- "recompute_all" over one region keeps nothing and peaks lowest (4.0 MiB, 0.24x), but
  pays for it in recompute: the bounded recompute cache (Note [Bounded recompute cache])
  runs each segment of the forward again where backward reaches it, 476 op runs, about 1.9
  forwards, where ``torch.utils.checkpoint`` per block runs one.
- Keeping block outputs (``save_module_outputs(Block)``) peaks about as low (0.24x) and
  recomputes 230 ops: each recompute is bounded to one block.
- Policies that keep most values (``recompute_ops(gelu, layer_norm)``, where no policy
  answers for the other ops and the default keeps them; ``offload`` on CPU tensors, which
  keeps) peak *above* the step without checkpointing (1.10x): they also keep values that
  backward never reads (2.0 MiB here, ``region.summary().unused_kept_bytes``), held until
  the region exits, where autograd frees them during the forward. The script lists such
  rows after the table.

Run:
    python examples/policies.py
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import ckpt_graph as cg
from ckpt_graph import policies
from ckpt_graph.memory import measure, measure_with_result

aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, heads: int = 4, depth: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(depth))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def every_other_block(name: str, module: nn.Module) -> bool:
    """Keep the outputs of layers.0, layers.2, ...: sqrt(N)-style checkpointing."""
    return isinstance(module, Block) and int(name.rsplit(".", 1)[-1]) % 2 == 0


def big_outputs(ctx: Any, out: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return bool(ctx.out_bytes >= 64 * 1024)


def sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A torch.utils.checkpoint selective-checkpoint policy, as existing SAC users have."""
    if op in (aten.mm.default, aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def kept_storage_bytes(region: cg.Region) -> int:
    """Bytes of the distinct storages the region keeps (a kept view costs nothing extra)."""
    storages = {}
    for node in region.nodes:
        for h in node.outputs:
            if h is not None and h.value is not None:
                storage = h.value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def train_step(
    model: nn.Module, idx: torch.Tensor, policy: Any, inner: Any = None
) -> tuple[cg.Region | None, int]:
    """Forward + backward; ``policy`` opens one region, ``inner`` is pushed inside it.

    Returns the region and the bytes it kept at the end of the forward.
    """
    model.zero_grad(set_to_none=True)
    region, kept = None, 0
    if policy is None:
        loss = model(idx).logsumexp(-1).mean()
    else:
        with cg.save_recompute_policy(policy) as region:
            if inner is None:
                loss = model(idx).logsumexp(-1).mean()
            else:
                with cg.save_recompute_policy(inner):
                    loss = model(idx).logsumexp(-1).mean()
        kept = kept_storage_bytes(region)
    loss.backward()
    return region, kept


def main() -> None:
    torch.manual_seed(0)
    model = GPT()
    idx = torch.randint(0, 64, (4, 128))

    eager = copy.deepcopy(model)
    eager_peak = measure(train_step, eager, idx, None).peak_bytes
    ref = [p.grad for p in eager.parameters()]

    cases: list[tuple[str, Any, Any]] = [
        ("recompute_all", "recompute_all", None),
        ("save_matmuls()", policies.save_matmuls(), None),
        ("save_ops(aten.addmm)", policies.save_ops(aten.addmm), None),
        (
            "recompute_ops(gelu, layer_norm)",
            policies.recompute_ops(aten.gelu, aten.native_layer_norm),
            None,
        ),
        ("save_module_outputs(Block)", policies.save_module_outputs(Block), None),
        ("save_module_outputs(every other)", policies.save_module_outputs(every_other_block), None),
        ("save_module_outputs('**.mlp')", policies.save_module_outputs("**.mlp"), None),
        # Nesting: the union of two selections (see Note [Built-in policy strengths]).
        (
            "save_matmuls() + blocks nested",
            policies.save_matmuls(),
            policies.save_module_outputs(Block),
        ),
        # Offload goes inside a policy that recomputes the rest (innermost PREFER wins).
        ("recompute_all + offload(big)", "recompute_all", policies.offload(big_outputs)),
        (
            "any_save(mm, every other)",
            policies.any_save(
                policies.save_ops(aten.mm, aten.addmm),
                policies.save_module_outputs(every_other_block),
            ),
            None,
        ),
        ("from_torch_sac(sac_policy)", policies.from_torch_sac(sac_policy), None),
        ("from_torch_sac([addmm])", policies.from_torch_sac([aten.addmm.default]), None),
    ]

    mib = 2.0**20
    print(
        f"{'policy':36} {'kept MiB':>9} {'peak MiB':>9} {'x none':>7} {'recomputed':>10} "
        f"{'x fwd':>6} {'max |dgrad|':>12}"
    )
    print(
        f"{'(no checkpointing)':36} {'-':>9} {eager_peak / mib:>9.1f} {1:>7.2f} {'-':>10} "
        f"{'-':>6} {'-':>12}"
    )
    above = []
    for label, policy, inner in cases:
        m = copy.deepcopy(model)
        (region, kept), report = measure_with_result(train_step, m, idx, policy, inner)
        assert region is not None
        recomputed = sum(node.realized for node in region.nodes)
        diff = max(
            (a - p.grad).abs().max().item() for a, p in zip(ref, m.parameters(), strict=True)
        )
        ratio = report.peak_bytes / eager_peak
        print(
            f"{label:36} {kept / mib:>9.1f} {report.peak_bytes / mib:>9.1f} {ratio:>7.2f} "
            f"{recomputed:>10} {recomputed / len(region.nodes):>6.2f} {diff:>12.1e}"
        )
        if ratio > 1:
            above.append(label)
    if above:
        print(
            f"\nabove the step without checkpointing: {', '.join(above)}; these policies "
            "keep values backward never reads (summary().unused_kept_bytes) until the region "
            "exits, where autograd frees them during the forward"
        )

    # torch.utils.checkpoint users pass the same sac_policy as
    #     context_fn = functools.partial(create_selective_checkpoint_contexts, sac_policy)
    #     torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    # and migrate with one line: save_recompute_policy(policies.from_torch_sac(sac_policy)).


if __name__ == "__main__":
    main()
