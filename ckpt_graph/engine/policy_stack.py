"""The policy stack of a region: one policy per open ``save_recompute_policy`` block.

The stack answers for every recorded op (see Note [Policy stack resolution]): either with
one constant decision, when every policy on it is a string-named one, or by asking its
policies through ``resolve`` with the region's reusable :class:`PolicyContext`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.utils.checkpoint import CheckpointPolicy

from ckpt_graph.engine.decisions import POLICY_NAMES, PolicyContext, PolicyFn, policy_name, resolve

if TYPE_CHECKING:
    from ckpt_graph.engine.region import Region

__all__ = ["PolicyStack"]


class PolicyStack:
    """The policies of a region's open blocks, outermost first, and what they decide alike.

    Attributes:
        policies: the policies, outermost first.
        names: their names, parallel to ``policies`` (an op node's ``decided_by``).
        constant: the decision of a stack of string-named policies, which decides every op
            alike without calling anything (``record_node`` makes the op node with it);
            ``None`` when some policy is a callable to ask per op.
        constant_by: the name of the policy that decided ``constant`` (``""`` if none).
        ctx: the context policies are asked with, while the region is open (one object per
            region, updated before each call); ``None`` otherwise.

    Invariants:
        ``len(names) == len(policies)``; ``constant`` is what ``resolve`` answers for the
        stack whenever every policy on it is string-named.

    Example:
        >>> stack = PolicyStack()
        >>> stack.push(region, "recompute_all")  # doctest: +SKIP
        >>> stack.constant  # doctest: +SKIP
        <CheckpointPolicy.PREFER_RECOMPUTE: 3>
    """

    __slots__ = ("constant", "constant_by", "ctx", "names", "policies")

    def __init__(self) -> None:
        self.policies: list[PolicyFn] = []
        self.names: list[str] = []
        self.constant: CheckpointPolicy | None = None
        self.constant_by = ""
        self.ctx: PolicyContext | None = None

    # Note [Failed policy push]
    # A policy's ``on_region_enter`` may raise (a bad argument, a budget that cannot be
    # planned). The block that pushed it then never runs, so nothing it pushed may stay: the
    # policy is taken off the stack again before the error propagates, and later ops of an
    # enclosing block are decided as if the failed block had never been entered.
    def push(self, region: Region, policy: PolicyFn) -> None:
        """Push the policy of a block entering ``region``, and tell the policy."""
        self.policies.append(policy)
        self.names.append(policy_name(policy))
        self._update_constant(region)
        hook = getattr(policy, "on_region_enter", None)
        if hook is not None:
            try:
                hook(region)
            except BaseException:  # See Note [Failed policy push].
                self.policies.pop()
                self.names.pop()
                self._update_constant(region)
                raise

    def pop(self, region: Region) -> None:
        """Pop the policy of the block leaving ``region``, and tell the policy."""
        policy = self.policies.pop()
        self.names.pop()
        self._update_constant(region)
        hook = getattr(policy, "on_region_exit", None)
        if hook is not None:
            hook(region)

    def _update_constant(self, region: Region) -> None:
        consts = [p for p in self.policies if p in POLICY_NAMES.values()]
        self.constant = None
        self.constant_by = ""
        if self.policies and len(consts) == len(self.policies):
            self.constant, self.constant_by = resolve(
                self.policies, PolicyContext(region), None, None, (), {}, self.names
            )
