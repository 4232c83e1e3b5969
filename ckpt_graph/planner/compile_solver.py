"""``memory_budget`` under torch.compile: the planner inside the compiler's partitioner.

# Note [memory_budget under torch.compile]
# Under torch.compile a region's ops are never recorded (Note [Regions under torch.compile]
# in engine/lowering.py), so ``memory_budget`` cannot plan from a recorded step. What the
# compiler does have is the joint forward+backward graph of the whole compiled frame, which
# AOT autograd's min-cut partitioner splits into what the forward keeps and what the
# backward recomputes. With ``activation_memory_budget = f < 1`` it first asks a 0-1
# knapsack which *candidates* (``all_recomputable_banned_nodes``: forward values the
# backward needs that its cheapest min-cut would keep, largest first) may be recomputed,
# then runs the min-cut again with those allowed. The knapsack's view is coarse:
#   - ``memory[i]``: candidate i's bytes as a fraction of (what the runtime-optimized cut
#     keeps - the graph inputs); ``max_memory``: ``f``. A recomputed candidate is assumed to
#     free its bytes, whereas the cut may then keep its inputs instead; bytes are summed, with
#     no liveness (views, what backward holds while it recomputes).
#   - its value is torch's runtime estimate (FLOPs, 1 for every memory-bound op).
# ``torch._functorch.config.activation_memory_budget_solver`` takes a ``CustomKnapsackSolver``
# ``(memory, joint_graph, max_memory, node_info, candidates) -> (kept, recomputed)`` indices.
# ``CompileSolver`` is one, planned by ckpt_graph's rules:
#   1. Seed: torch's own answer at the same ``f`` (its DP knapsack on its runtime estimates),
#      so the plan starts from what ``activation_memory_budget=f`` alone gives. The solver is
#      called with dispatch disabled, where torch's FLOP-counting estimator counts nothing
#      (every candidate then weighs 1, and the seed was another plan: on a 4-block GPT at
#      0.3, 36% below torch's peak but with 2.6% more backward FLOPs); the seed takes the
#      same FLOPs from the formulas instead.
#   2. Every candidate answer is evaluated on what it *does*: the partitioner's min-cut is
#      run with it (the same call the partitioner makes next), giving the values the forward
#      keeps; the values the backward must recompute follow (forward values the backward
#      reaches through values not kept). Kept bytes count each storage once; the backward is
#      simulated as the partitioner emits it (recomputed and backward nodes in the joint
#      graph's order: recomputed values come first), every value freed after its last use
#      and returned gradients held to the end: the simulated peak of backward (liveness). Recompute cost is the project's cost model (``op_cost``: FLOPs
#      for ops with a formula, bytes moved x ``flops_per_byte`` for memory-bound ones).
#   2b. A second seed: the knapsack with every candidate weighing the same (keep as many as
#      fit). It replaces torch's answer as the start only if it is no worse in all four
#      measures below; on transformers' GPT-2 at 0.3 it is, and peaks 17% lower at equal
#      backward FLOPs (bench_compile_budget.py).
#   3. Local search from the start, accepting only answers that keep no more bytes, peak no
#      higher in the simulation, cost no more recompute and recompute no more FLOPs than the
#      seed: first recompute
#      less (drop the costliest recomputed candidates while the bounds hold), then keep less
#      at no more cost. The answer is thus never worse than ``activation_memory_budget=f`` in
#      the model, and it is torch's where nothing better is found. Evaluations are capped
#      (``max_evals``) so that compile time stays bounded.
#   4. Scope: the engine sets the solver and ``f`` in torch's config only while dynamo
#      compiles a frame whose graph holds a region with this policy, restoring them when that
#      compile ends (Note [Regions under torch.compile] rule 5 in engine/lowering.py).
#   5. A budget in bytes has no lowering (the partitioner's budget is a fraction): the region
#      falls back to running eagerly behind a graph break, with a warning, as before.
# Each call leaves a ``CompileReport`` on the solver (``reports``): torch's seed and the
# chosen answer, each as kept bytes, simulated peak and recompute cost.
# Known limitations: the plan is over torch's candidates only (values the cheapest cut would
# keep); everything else stays the min-cut's. The simulation is not byte-exact: it does not
# see inductor's fusion and reordering, nor when the autograd engine takes the returned
# gradients; on a 3-block MLP (tests/integration/test_compile_budget.py) an answer with equal
# simulated peak measured 1 KiB (0.4%) above torch's. When torch's answer is left as is, the
# partition is torch's, byte for byte. Each answer evaluated costs one min-cut (about 0.1 s
# on a 3-block GPT on CPU), so compile time grows by up to ``max_evals`` of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch._inductor.custom_graph_pass import CustomKnapsackSolver

from ckpt_graph._errors import CkptGraphValueError
from ckpt_graph.engine.flops import estimate_flops, has_flop_formula
from ckpt_graph.planner.cost_model import machine_flops_per_byte, op_cost

if TYPE_CHECKING:
    from torch import fx

__all__ = ["CompileOutcome", "CompileReport", "CompileSolver", "solver_for"]

_MAX_EVALS = 160


@dataclass(frozen=True)
class CompileOutcome:
    """What one answer to the partitioner's knapsack does, in the model of Note [memory_budget
    under torch.compile] (2).

    Attributes:
        recomputed: indices of the candidates the answer lets the min-cut recompute.
        kept_bytes: bytes the forward keeps for backward (each storage once).
        peak_bytes: simulated peak of kept + recomputed + backward values during backward.
        recompute_cost: recompute cost of the values backward recomputes (FLOP units).
        recompute_flops: FLOPs of those of them with a FLOP formula (matmuls, attention).
    """

    recomputed: tuple[int, ...]
    kept_bytes: int
    peak_bytes: int
    recompute_cost: int
    recompute_flops: int

    def no_worse_than(self, other: CompileOutcome) -> bool:
        return (
            self.kept_bytes <= other.kept_bytes
            and self.peak_bytes <= other.peak_bytes
            and self.recompute_cost <= other.recompute_cost
            and self.recompute_flops <= other.recompute_flops
        )


@dataclass(frozen=True)
class CompileReport:
    """One partitioned graph: torch's seed answer and the one the solver chose."""

    fraction: float
    candidates: int
    evaluations: int
    torch_answer: CompileOutcome
    chosen: CompileOutcome

    def __str__(self) -> str:
        rows = [
            f"memory_budget({self.fraction}) under torch.compile: {self.candidates} candidates, "
            f"{self.evaluations} answers evaluated",
            f"{'':<10}{'recomputed':>11}{'kept MiB':>10}{'peak MiB':>10}{'recompute':>14}",
        ]
        for name, o in (("torch", self.torch_answer), ("chosen", self.chosen)):
            rows.append(
                f"{name:<10}{len(o.recomputed):>11}{o.kept_bytes / 2**20:>10.2f}"
                f"{o.peak_bytes / 2**20:>10.2f}{o.recompute_cost:>14.3g}"
            )
        return "\n".join(rows)


class CompileSolver(CustomKnapsackSolver):
    """The partitioner's knapsack solver for a ``memory_budget`` fraction under torch.compile.

    See Note [memory_budget under torch.compile].

    Attributes:
        fraction: the budget, a fraction in (0, 1) of the partitioner's activation range.
        flops_per_byte: the cost model's calibration (``None``: the machine's, see
            ``machine_flops_per_byte``).
        max_evals: cap on the answers evaluated per graph.
        reports: one ``CompileReport`` per graph planned, oldest first.

    Example:
        >>> solver = CompileSolver(0.5, flops_per_byte=4.0)
        >>> solver.fraction, solver.reports
        (0.5, [])
    """

    def __init__(
        self, fraction: float, *, flops_per_byte: float | None = None, max_evals: int = _MAX_EVALS
    ) -> None:
        self.fraction = fraction
        self.flops_per_byte = flops_per_byte
        self.max_evals = max_evals
        self.reports: list[CompileReport] = []

    def __repr__(self) -> str:
        return f"CompileSolver({self.fraction!r})"

    def uuid(self) -> Any:
        # Plans depend on the graph's sizes and on calibration: no cached partition reused.
        return None

    def __call__(
        self,
        memory: list[float],
        joint_graph: fx.Graph,
        max_memory: float,
        node_info: Any,
        all_recomputable_banned_nodes: list[fx.Node],
    ) -> tuple[list[int], list[int]]:
        from torch._functorch import config
        from torch._functorch._activation_checkpointing.knapsack import dp_knapsack
        from torch._functorch.partitioners import estimate_runtime

        candidates = all_recomputable_banned_nodes
        if config.activation_memory_budget_runtime_estimator == "flops":
            # torch's estimate (FLOPs, at least 1), from the same formulas: its
            # FlopCounterMode counts nothing here, the partitioner calls us with dispatch off
            runtimes = [float(max(_node_flops(n), 1)) for n in candidates]
        else:
            runtimes = [estimate_runtime(n) for n in candidates]
        _, _, seed = dp_knapsack(memory, runtimes, max_memory)
        fpb = self.flops_per_byte if self.flops_per_byte is not None else machine_flops_per_byte()
        model = _GraphModel(joint_graph, node_info, candidates, fpb)
        start = model.evaluate(seed)
        # a second seed: keep as many candidates as fit (every one weighs the same)
        _, _, fewest = dp_knapsack(memory, [1.0] * len(candidates), max_memory)
        other = model.evaluate(fewest)
        first = other if other.no_worse_than(start) and other != start else start
        best, evals = _search(model, first, start, self.max_evals)
        evals += 1
        self.reports.append(CompileReport(max_memory, len(candidates), evals, start, best))
        chosen = set(best.recomputed)
        return [i for i in range(len(candidates)) if i not in chosen], sorted(chosen)


def solver_for(policy: Any) -> CompileSolver:
    """A ``CompileSolver`` for a ``memory_budget`` policy object's fraction and cost ratio.

    The policy keeps the one it makes (``MemoryBudget.compile_solver()``), so its
    ``reports`` accumulate over the compiles that policy planned.
    """
    fraction = policy.compile_fraction
    if fraction is None:
        raise CkptGraphValueError(
            f"ckpt_graph: {policy!r} has a budget in bytes, which torch.compile's "
            "partitioner cannot plan (it takes a fraction); pass a fraction such as 0.5"
        )
    return CompileSolver(fraction, flops_per_byte=policy.flops_per_byte)


def _search(
    model: _GraphModel, first: CompileOutcome, start: CompileOutcome, max_evals: int
) -> tuple[CompileOutcome, int]:
    """Local search from ``first``, never worse than torch's answer ``start``; see Note
    [memory_budget under torch.compile] (3)."""
    best, evals = first, 1
    # 1. recompute less: keep the costliest recomputed candidates while the bounds hold
    for i in sorted(best.recomputed, key=model.cost_of, reverse=True):
        if evals >= max_evals:
            return best, evals
        trial = model.evaluate([j for j in best.recomputed if j != i])
        evals += 1
        if trial.no_worse_than(start) and trial.recompute_cost < best.recompute_cost:
            best = trial
    # 2. recompute cheaper: swap a recomputed candidate for a cheaper kept one
    for i in sorted(best.recomputed, key=model.cost_of, reverse=True):
        if i not in best.recomputed:
            continue
        kept = set(range(model.size)) - set(best.recomputed)
        for j in sorted(kept, key=model.cost_of):
            if model.cost_of(j) >= model.cost_of(i):
                break
            if evals >= max_evals:
                return best, evals
            trial = model.evaluate([*(k for k in best.recomputed if k != i), j])
            evals += 1
            if trial.no_worse_than(start) and trial.recompute_cost < best.recompute_cost:
                best = trial
                break
    # 3. keep less at no more cost: let the largest kept candidates be recomputed
    for i in sorted(
        set(range(model.size)) - set(best.recomputed), key=model.bytes_of, reverse=True
    ):
        if evals >= max_evals:
            break
        trial = model.evaluate([*best.recomputed, i])
        evals += 1
        if (
            trial.recompute_cost <= best.recompute_cost
            and trial.recompute_flops <= best.recompute_flops
            and trial.kept_bytes <= best.kept_bytes
            and trial.peak_bytes < best.peak_bytes
        ):
            best = trial
    return best, evals


class _GraphModel:
    """Kept bytes, simulated backward peak and recompute cost of the partitioner's answers."""

    def __init__(
        self, graph: fx.Graph, node_info: Any, candidates: list[fx.Node], flops_per_byte: float
    ) -> None:
        from torch._functorch import config
        from torch._functorch.partitioners import MinCutOptions

        self.graph = graph
        self.node_info = node_info
        self.candidates = candidates
        self.size = len(candidates)
        self.flops_per_byte = flops_per_byte
        # the options of the partitioner's final cut (its "aggressive" ones)
        self.options = MinCutOptions(
            ban_if_used_far_apart=False,
            ban_if_long_fusible_chains=False,
            ban_if_materialized_backward=False,
            ban_if_not_in_allowlist=False,
            ban_if_reduction=config.ban_recompute_reductions,
        )
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.backward = [
            n
            for n in graph.nodes
            if n.op == "call_function"
            and not node_info.is_required_fw(n)
            and node_info.is_required_bw(n)
        ]
        self._costs: dict[fx.Node, int] = {}
        self._flop_counts: dict[fx.Node, int] = {}
        self._seen: dict[tuple[int, ...], CompileOutcome] = {}

    def bytes_of(self, i: int) -> int:
        return _nbytes(self.candidates[i])

    def cost_of(self, i: int) -> int:
        return self._cost(self.candidates[i])

    def evaluate(self, recomputed: list[int]) -> CompileOutcome:
        key = tuple(sorted(recomputed))
        found = self._seen.get(key)
        if found is not None:
            return found
        from torch._functorch.partitioners import solve_min_cut
        from torch.utils._ordered_set import OrderedSet

        dont_ban = OrderedSet(self.candidates[i] for i in key)
        kept, _ = solve_min_cut(self.graph, self.node_info, self.options, dont_ban)
        outcome = self._simulate(key, [n for n in kept if _nbytes(n) > 0])
        self._seen[key] = outcome
        return outcome

    def _simulate(self, key: tuple[int, ...], kept: list[fx.Node]) -> CompileOutcome:
        kept_set = set(kept)
        forward = self.node_info
        # forward values backward recomputes: reached from backward through values not kept
        recomputed: set[fx.Node] = set()
        stack = [a for b in self.backward for a in b.all_input_nodes]
        while stack:
            n = stack.pop()
            if (
                n in kept_set
                or n in recomputed
                or n.op != "call_function"
                or not forward.is_required_fw(n)
            ):
                continue
            recomputed.add(n)
            stack.extend(n.all_input_nodes)
        cost = sum(self._cost(n) for n in recomputed)
        flops = sum(self._flops(n) for n in recomputed)
        # the backward graph as the partitioner emits it: recomputed and backward nodes in
        # the joint graph's order; every value is freed once its last consumer there ran
        computed = sorted([*recomputed, *self.backward], key=self.order.__getitem__)
        users: dict[fx.Node, int] = {}
        for n in computed:
            for a in n.all_input_nodes:
                users[a] = users.get(a, 0) + 1
            if any(u.op == "output" for u in n.users):
                users[n] = users.get(n, 0) + 1  # a gradient returned: alive to the end
        storages: dict[Any, int] = {}  # storage -> live values on it
        live = 0

        def hold(n: fx.Node) -> int:
            s = _storage(n)
            storages[s] = storages.get(s, 0) + 1
            return _nbytes(n) if storages[s] == 1 else 0

        def drop(n: fx.Node) -> int:
            s = _storage(n)
            storages[s] -= 1
            return _nbytes(n) if storages[s] == 0 else 0

        peak = self._forward_peak(kept_set)
        for n in kept:
            live += hold(n)
        kept_bytes = live
        peak = max(peak, live)
        alive: set[fx.Node] = set(kept)
        for n in computed:
            live += hold(n)
            alive.add(n)
            peak = max(peak, live)
            live -= self._release(n, users, alive, drop)
        return CompileOutcome(key, kept_bytes, peak, cost, flops)

    def _forward_peak(self, kept: set[fx.Node]) -> int:
        """Simulated forward peak: kept values and forward outputs stay, others are freed
        after their last forward use."""
        forward = [n for n in self.node_info.required_fw_nodes if n.op == "call_function"]
        users: dict[fx.Node, int] = {}
        for n in forward:
            for a in n.all_input_nodes:
                users[a] = users.get(a, 0) + 1
        storages: dict[Any, int] = {}
        live = peak = 0
        for n in forward:
            s = _storage(n)
            storages[s] = storages.get(s, 0) + 1
            if storages[s] == 1:
                live += _nbytes(n)
            peak = max(peak, live)
            for a in n.all_input_nodes:
                if a not in users:
                    continue
                users[a] -= 1
                stays = a in kept or any(u.op == "output" for u in a.users)
                if users[a] == 0 and not stays and a.op == "call_function":
                    t = _storage(a)
                    storages[t] -= 1
                    if storages[t] == 0:
                        live -= _nbytes(a)
        return peak

    @staticmethod
    def _release(n: fx.Node, users: dict[fx.Node, int], alive: set[fx.Node], drop: Any) -> int:
        freed = 0
        for a in n.all_input_nodes:
            if a not in alive:
                continue
            users[a] -= 1
            if users[a] == 0:
                alive.discard(a)
                freed += drop(a)
        if users.get(n, 0) == 0:  # nothing in backward reads it
            alive.discard(n)
            freed += drop(n)
        return freed

    def _cost(self, n: fx.Node) -> int:
        found = self._costs.get(n)
        if found is None:
            found = self._costs[n] = op_cost(_node_flops(n), _moved(n), self.flops_per_byte)
        return found

    def _flops(self, n: fx.Node) -> int:
        found = self._flop_counts.get(n)
        if found is None:
            found = self._flop_counts[n] = _node_flops(n)
        return found


def _val(a: Any) -> Any:
    from torch import fx

    if isinstance(a, fx.Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_val(x) for x in a)
    return a


def _node_flops(n: fx.Node) -> int:
    """FLOPs of one FX node from torch's formulas (0: none, a memory-bound op)."""
    target = n.target
    if not has_flop_formula(target):
        return 0
    try:
        return estimate_flops(target, n.meta.get("val"), _val(n.args), _val(n.kwargs))
    except Exception:  # symbolic sizes a formula cannot evaluate: a memory-bound estimate
        return 0


def _moved(n: fx.Node) -> int:
    """Bytes one FX node reads and writes (its tensor inputs and outputs)."""
    return _nbytes(n) + sum(_nbytes(a) for a in n.all_input_nodes)


def _nbytes(n: fx.Node) -> int:
    from torch._functorch.partitioners import _size_of

    val = n.meta.get("val")
    if isinstance(val, torch.Tensor) or (
        isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val)
    ):
        return int(_size_of(n))
    return 0


def _storage(n: fx.Node) -> Any:
    from torch._inductor.fx_utils import get_node_storage

    s = get_node_storage(n)
    return s if s is not None else n
