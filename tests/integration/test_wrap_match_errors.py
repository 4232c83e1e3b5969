"""``wrap(match=...)`` that selects nothing names what the model has (issue 21 item 15).

The error used to suggest ``'layers.*'``, the very pattern that had failed on a model whose
module list is named ``blocks``.
"""

from __future__ import annotations

import re

import pytest
from torch import nn

import ckpt_graph as cg


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.heads = nn.ModuleList([nn.Linear(4, 8)])
        self.out = nn.Linear(4, 8)


def test_a_pattern_that_matches_nothing_lists_the_module_lists() -> None:
    with pytest.raises(
        cg.CkptGraphValueError,
        match=re.escape(
            "ckpt_graph: wrap() found nothing matched 'layers.*' in Net; its module lists "
            "match 'blocks.*' (3 modules), 'heads.*' (1 module). Pass match= a name pattern"
        ),
    ) as info:
        cg.wrap(Net(), match="layers.*")
    assert "layers" not in str(info.value).split("Net;")[1]  # never suggests what failed
    cg.wrap(Net(), match="blocks.*")  # the suggestion works


def test_without_module_lists_the_error_lists_the_submodules() -> None:
    model = nn.Sequential()
    model.add_module("enc", nn.Linear(2, 2))
    model.add_module("dec", nn.Linear(2, 2))
    with pytest.raises(
        cg.CkptGraphValueError,
        match=re.escape(
            "ckpt_graph: wrap() found no nn.ModuleList children in Sequential; its submodules "
            "are 'enc', 'dec'. Pass match="
        ),
    ):
        cg.wrap(model)
    with pytest.raises(cg.CkptGraphValueError, match="Linear has no submodules"):
        cg.wrap(nn.Linear(2, 2), match="x")
