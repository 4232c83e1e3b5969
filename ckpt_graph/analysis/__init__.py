"""Introspection of a region: its recorded graph, what it keeps, and what recomputing costs.

``Region.graph``, ``Region.to_networkx()``, ``Region.to_dot()``, ``Region.summary()`` and
``Region.explain(t)`` call the functions of this package. They read only metadata, so they
work during the forward, after it and after backward (when the region has freed every
tensor value).

Example:
    >>> with ckpt_graph.save_recompute_policy(my_policy) as region:  # doctest: +SKIP
    ...     loss = model(x).sum()
    >>> print(region.summary())          # what is kept, by reason and by policy
    >>> print(region.explain(hidden))    # why this value is kept, what recomputing costs
    >>> region.to_networkx()             # networkx.DiGraph of op nodes and region inputs
"""

from __future__ import annotations

from ckpt_graph.analysis.explanation import Explanation, explain
from ckpt_graph.analysis.export import OpRecord, graph, to_dot, to_networkx
from ckpt_graph.analysis.region_summary import RegionSummary, summary

__all__ = [
    "Explanation",
    "OpRecord",
    "RegionSummary",
    "explain",
    "graph",
    "summary",
    "to_dot",
    "to_networkx",
]
