"""Every code block of the README runs as written (issue 21 item 15).

Python blocks run one by one, each in a fresh namespace holding the names the README's text
assumes (:func:`_names`):

- ``torch``, ``cg`` (``import ckpt_graph as cg``) and ``policies`` (``ckpt_graph.policies``);
- ``model``: a small decoder (:class:`TinyGPT`) with ``embed``, ``blocks`` (an
  ``nn.ModuleList`` of blocks with ``attn`` and ``mlp``) and ``head``; ``model(idx)`` returns
  logits;
- ``x``, ``batch``, ``idx``, ``ids``: one batch of token ids; ``loader``: three batches;
- ``trainer``: an object whose ``train()`` runs one step of ``model`` calling
  ``torch.utils.checkpoint.checkpoint`` around each block (code you do not control);
- in a block that imports ``ckpt_graph.integrations.transformers``: ``model`` is a tiny
  transformers GPT-2 instead (skipped without transformers).

A block that cannot run here (several processes, elided arguments) is preceded by the line
``<!-- not run: REASON -->``; it must still compile. Shell blocks are checked, not run:
every ``pip install`` installs this checkout with extras that exist (the package is not on
an index), and every ``python -m ckpt_graph compare ...`` command, in a block or inline,
parses with the command's own argument checks.
"""

from __future__ import annotations

import ast
import re
import shlex
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt_graph as cg
from ckpt_graph.compare import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOT_RUN = re.compile(r"^<!-- not run: (?P<why>\S.*\S) -->$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")


class Block(types.SimpleNamespace):
    lang: str
    line: int
    code: str
    not_run: str | None


def _blocks() -> list[Block]:
    lines = README.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        end = i + 1
        while not lines[end].startswith("```"):
            end += 1
        marker = NOT_RUN.match(lines[i - 1]) if i else None
        blocks.append(
            Block(
                lang=m["lang"],
                line=i + 1,
                code="\n".join(lines[i + 1 : end]) + "\n",
                not_run=marker["why"] if marker else None,
            )
        )
        i = end + 1
    return blocks


BLOCKS = _blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell")]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.Linear(width, 3 * width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, w = h.shape
        q, k, v = self.attn(self.ln1(h)).view(b, s, 3, self.heads, w // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = h + a.transpose(1, 2).reshape(b, s, w)
        return h + self.mlp(self.ln2(h))


class TinyGPT(nn.Module):
    """The README's ``model``: ``embed``, ``blocks``, ``head``; returns logits."""

    def __init__(self, vocab: int = 32, width: int = 16, layers: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class _Trainer:
    """Code that calls ``torch.utils.checkpoint.checkpoint`` itself, as libraries do."""

    def __init__(self, model: TinyGPT, batch: torch.Tensor) -> None:
        self.model, self.batch = model, batch

    def train(self) -> None:
        h = self.model.embed(self.batch)
        for block in self.model.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        self.model.head(h).sum().backward()


def _names(block: Block) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT().train()
    batches = [torch.randint(0, 32, (2, 8)) for _ in range(3)]
    names: dict[str, Any] = {
        "torch": torch,
        "cg": cg,
        "policies": cg.policies,
        "model": model,
        "x": batches[0],
        "batch": batches[0],
        "idx": batches[0],
        "ids": batches[0],
        "loader": batches,
        "trainer": _Trainer(model, batches[0]),
    }
    if "ckpt_graph.integrations import transformers" in block.code:
        pytest.importorskip("transformers")
        from hf_models import VOCAB, build

        names["model"] = build("gpt2", layers=2)
        names["ids"] = torch.randint(0, VOCAB, (2, 16))
    return names


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)  # files a block writes (memory.png) land here
    yield tmp_path


def test_the_readme_has_the_blocks_this_test_expects() -> None:
    assert len(PYTHON) >= 8 and len(SHELL) >= 3
    assert sum(b.not_run is not None for b in PYTHON) <= 3  # running is the rule


@pytest.mark.parametrize("block", PYTHON, ids=[f"line{b.line}" for b in PYTHON])
def test_python_block_runs(block: Block, in_tmp: Path) -> None:
    tree = compile(block.code, f"README.md:{block.line}", "exec", flags=ast.PyCF_ONLY_AST)
    if block.not_run is not None:
        return  # compiled above; see the marker's reason
    if "plot(" in block.code:
        pytest.importorskip("matplotlib")
    names = _names(block)
    exec(compile(tree, f"README.md:{block.line}", "exec"), names)


def _commands(text: str) -> Iterator[list[str]]:
    """Shell commands of ``text``: lines split at ``&&``, comments dropped."""
    for line in text.splitlines():
        line = line.split("  #", 1)[0].strip()
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words:
                yield words


def _extras() -> set[str]:
    """The extras pyproject.toml declares (read as text: tomllib needs Python 3.11)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, flags=re.M))


def _pip_installs() -> Iterator[tuple[str, list[str]]]:
    for b in SHELL:
        for words in _commands(b.code):
            if words[:2] == ["pip", "install"]:
                yield f"README.md:{b.line}", words[2:]
    for m in re.finditer(r"`(pip install [^`]+)`", README.read_text()):
        yield "README.md (inline)", shlex.split(m[1])[2:]


def test_pip_installs_install_this_checkout_with_existing_extras() -> None:
    extras = _extras()
    seen = 0
    for where, args in _pip_installs():
        for k, arg in enumerate(args):
            if arg.startswith("ckpt_graph") or arg.startswith("ckpt-graph"):
                pytest.fail(f"{where}: pip install {arg}: ckpt_graph is not on an index")
            if k and args[k - 1] == "-e":
                m = re.fullmatch(r"\.(?:\[(?P<extras>[\w,]+)\])?", arg)
                assert m is not None, f"{where}: -e {arg} is not this checkout"
                wanted = set((m["extras"] or "").split(",")) - {""}
                assert wanted <= extras, f"{where}: unknown extras {wanted - extras}"
                seen += 1
    assert seen >= 3


def test_no_file_tells_users_to_install_from_an_index() -> None:
    wrong = re.compile(r"pip install ['\"]?ckpt[_-]graph")
    for path in [README, *ROOT.glob("examples/*.py"), *ROOT.glob("ckpt_graph/**/*.py")]:
        assert not wrong.search(path.read_text()), path


def _compare_commands() -> Iterator[tuple[str, list[str]]]:
    for b in SHELL:
        for words in _commands(b.code):
            if words[:3] == ["python", "-m", "ckpt_graph"]:
                yield f"README.md:{b.line}", words[3:]
    for m in re.finditer(r"`python -m ckpt_graph ([^`]+)`", README.read_text()):
        yield "README.md (inline)", shlex.split(m[1].replace("\n", " "))


def test_compare_commands_parse(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ran: list[dict[str, Any]] = []
    monkeypatch.setattr(cli, "run_comparison", lambda **kw: ran.append(kw) or [])
    monkeypatch.setattr(cli, "format_table", lambda *a, **k: "")
    monkeypatch.setattr(cli, "write_json", lambda *a, **k: None)
    monkeypatch.setattr(cli, "plot", lambda *a, **k: None)
    monkeypatch.chdir(tmp_path)
    commands = list(_compare_commands())
    assert len(commands) >= 3
    for where, argv in commands:
        try:
            code = cli.main(argv)
        except SystemExit as e:  # --help, --version
            code = e.code
        assert code == 0, (
            f"{where}: python -m ckpt_graph {shlex.join(argv)}: {capsys.readouterr().err}"
        )


def test_ci_runs_the_readme_test_command_then_the_slow_tests() -> None:
    readme = [
        words
        for b in SHELL
        for words in _commands(b.code)
        if words[:3] == ["python", "-m", "pytest"]
    ]
    ci = [
        words
        for words in _commands((ROOT / ".ci" / "run").read_text())
        if words[:3] == ["python", "-m", "pytest"]
    ]
    assert readme and all(words == ["python", "-m", "pytest", "-m", "not slow"] for words in readme)
    assert ci == [readme[0], ["python", "-m", "pytest", "-m", "slow"]]
