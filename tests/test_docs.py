"""Every code block of the README and of the docs runs as shown, so none can rot.

Each ``python``, ``bash`` and ``console`` block of ``README.md`` and ``docs/**/*.md`` runs
unless an HTML comment right above it says otherwise, in a fresh namespace and a temporary
working directory:

* ``<!-- docs-test: setup=NAME (why) -->``: after the setup ``NAME`` below, which makes
  the objects the block talks about (``model``, ``optimizer``, checkpoint files) and
  nothing else: the block's own imports must be complete.
* ``<!-- docs-test: continues (why) -->``: in the namespace the block above left (on the
  same page).
* ``<!-- docs-test: transcript setup=NAME (why) -->`` on a ``console`` block: each
  ``$ command`` runs in bash and its output (stdout and stderr, as a terminal shows them)
  must be exactly the lines that follow it.
* ``<!-- docs-test: fragment (why) -->``: an illustrative listing, only compiled.
* ``<!-- docs-test: pytest (why) -->``: a test module; its tests run below.
* ``<!-- docs-test: ci (why) -->``: the quick start; ``.ci/run`` runs its lines verbatim.
* ``requires=MODULE[,MODULE...]`` (with any of the above, or alone): the block needs a
  package that is not a dependency (a trainer, an optional extra); it is skipped, with the
  reason, where one of those modules cannot be imported. ``.ci/run`` installs them all.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
KINDS = ("setup", "continues", "transcript", "fragment", "pytest", "ci")
MARKER = "<!-- docs-test:"
BLOCK = re.compile(
    r"(?:^<!-- docs-test: (?P<marker>[^\n]*?) -->\n)?^```(?P<lang>[\w-]*)\n(?P<code>.*?)^```$",
    re.M | re.S,
)


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    kind: str  # "run" or one of KINDS
    setup: str | None
    requires: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}-{self.lang}"

    def skip_if_unavailable(self) -> None:
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"{self.id} needs {module}, which is not installed")


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in BLOCK.finditer(text):
        lang = m["lang"]
        if lang not in ("python", "bash", "console"):
            continue
        kind, setup, requires = "run", None, ()
        marker = m["marker"]
        if marker:
            words = marker.split(" (")[0].split()
            for word in words:
                if word.startswith("setup="):
                    setup = word.removeprefix("setup=")
                    kind = "setup" if kind == "run" else kind
                elif word.startswith("requires="):
                    requires = tuple(word.removeprefix("requires=").split(","))
                else:
                    kind = word
        line = text[: m.start("code")].count("\n")
        out.append(Block(page, line, lang, m["code"], kind, setup, requires))
    return out


# -- setups: the objects a block talks about, nothing else -----------------------------


class Net(nn.Module):
    """A body and a head, and a sparse-attention indexer whose output is only indices."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.indexer = nn.Linear(4, 2)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _ = self.indexer(x).detach().topk(1).indices  # no gradient ever
        return self.head(torch.relu(self.body(x)))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def setup_trainer(tmp: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    old = Net()
    old_optimizer = torch.optim.AdamW(old.parameters(), lr=1e-3)
    _train(old, old_optimizer)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    torch.save(old.state_dict(), tmp / "model.pt")
    torch.save(get_optimizer_state_dict(old, old_optimizer, options=options), tmp / "optim.pt")
    model = Net()
    return {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "model_path": str(tmp / "model.pt"),
        "optim_path": str(tmp / "optim.pt"),
        "path": str(tmp / "optim.pt"),
    }


class Attention(nn.Module):
    def __init__(self, q: str, k: str) -> None:
        super().__init__()
        self.attn = nn.ModuleDict({q: nn.Linear(4, 4), k: nn.Linear(4, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(m(x) for m in self.attn.values())  # type: ignore[return-value]


def setup_renamed(tmp: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch.manual_seed(0)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    old = nn.Sequential(*(Attention("wq", "wk") for _ in range(2)))
    old = nn.ModuleDict({"layers": old})
    old_optimizer = torch.optim.AdamW(old.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randn(3, 4)
        for layer in old["layers"]:
            x = layer(x)
        x.sum().backward()
        old_optimizer.step()
        old_optimizer.zero_grad()
    loaded = {
        "model": old.state_dict(),
        "optim": get_optimizer_state_dict(old, old_optimizer, options=options),
    }
    model = nn.ModuleDict(
        {"layers": nn.Sequential(*(Attention("q_proj", "k_proj") for _ in range(2)))}
    )
    return {
        "loaded": loaded,
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "options": options,
    }


class LM(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab, bias=False)


def setup_lm(tmp: Path) -> dict[str, Any]:
    old_vocab = 32000
    return {"LM": LM, "old_vocab": old_vocab, "loaded": {"model": LM(old_vocab).state_dict()}}


class OldModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class ModelWithNewHead(OldModel):
    def __init__(self) -> None:
        super().__init__()
        self.new_head = nn.Linear(4, 3)


def setup_newhead(tmp: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    old_model = OldModel()
    optimizer = torch.optim.AdamW(old_model.parameters(), lr=1e-3)
    _train(old_model, optimizer)
    torch.save(optimizer.state_dict(), tmp / "optim.pt")
    return {"old_model": old_model, "ModelWithNewHead": ModelWithNewHead}


def setup_fresh_model(tmp: Path) -> dict[str, Any]:
    model = Net()
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}


def setup_cli_example(tmp: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cli_checkpoints.py"), str(tmp)],
        check=True,
        capture_output=True,
        env=env,
        timeout=300,
    )
    return {}


def setup_split_fused(tmp: Path) -> dict[str, Any]:
    torch.save({f"attn.{n}_proj.weight": torch.zeros(4, 8) for n in "qkv"}, tmp / "split.pt")
    torch.save({"attn.qkv_proj.weight": torch.zeros(12, 8)}, tmp / "fused.pt")
    return {}


SETUPS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "trainer": setup_trainer,
    "renamed": setup_renamed,
    "lm": setup_lm,
    "newhead": setup_newhead,
    "fresh-model": setup_fresh_model,
    "cli-example": setup_cli_example,
    "split-fused": setup_split_fused,
}


# -- the blocks ------------------------------------------------------------------------

ALL = [block for page in PAGES for block in blocks(page)]


def test_every_block_is_run_or_says_why_not():
    assert len(ALL) >= 10
    for block in ALL:
        assert block.kind in ("run", *KINDS), (block.id, block.kind)
        if block.setup is not None:
            assert block.setup in SETUPS, (block.id, block.setup)
        if block.kind == "continues":
            before = ALL[ALL.index(block) - 1]
            assert before.lang == "python", block.id
            assert before.page == block.page, block.id
        if block.kind == "transcript":
            assert block.lang == "console", block.id
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        markers = re.findall(r"<!-- docs-test: ([^\n]*?) -->\n```", text)
        # each marker right above a block
        assert len(markers) == text.count(MARKER), page
        assert "readme-test:" not in text, page  # the old spelling would be ignored


def _chains() -> list[list[Block]]:
    chains: list[list[Block]] = []
    for block in ALL:
        if block.lang != "python" or block.kind in ("fragment", "pytest"):
            continue
        if block.kind == "continues":
            chains[-1].append(block)
        else:
            chains.append([block])
    return chains


@pytest.mark.parametrize("chain", _chains(), ids=lambda chain: chain[0].id)
def test_python_block_runs(chain, tmp_path, monkeypatch):
    for block in chain:
        block.skip_if_unavailable()
    monkeypatch.chdir(tmp_path)
    first = chain[0]
    namespace: dict[str, Any] = {"__name__": "readme_block"}
    if first.setup is not None:
        namespace.update(SETUPS[first.setup](tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's, on a single process
        for block in chain:
            exec(compile(block.code, block.id, "exec"), namespace)


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "fragment"], ids=lambda b: b.id)
def test_fragments_compile(block):
    if block.lang == "python":
        compile(block.code, block.id, "exec")
    else:  # a listing of shell commands: bash parses it
        proc = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_quick_start_is_what_ci_runs():
    [quick] = [b for b in ALL if b.kind == "ci"]
    assert quick.page == README
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for line in quick.code.strip().splitlines():
        assert f'"{line}"' in ci, line


def test_readme_links_resolve():
    """README's relative links name files of the repository (mkdocs checks the docs' own)."""
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    broken = [
        link
        for link in links
        if not re.match(r"[a-z]+:", link)  # https:, mailto:
        and not (ROOT / link.split("#")[0]).exists()
    ]
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_policy_table_is_the_same_in_readme_and_docs():
    """One table of the policy rules: the README's is docs/merge.md's, row for row."""

    def table(path: Path) -> list[str]:
        lines = path.read_text(encoding="utf-8").splitlines()
        start = lines.index("| situation | `default` | `warn` | `strict` |")
        end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
        return lines[start:end]

    readme, docs = table(README), table(ROOT / "docs" / "merge.md")
    assert len(readme) > 10
    assert readme == docs


@pytest.mark.parametrize(
    "block", [b for b in ALL if b.lang == "bash" and b.kind == "run"], ids=lambda b: b.id
)
def test_bash_block_runs(block, tmp_path):
    block.skip_if_unavailable()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        ["bash", "-e", "-c", block.code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr


def _commands(code: str) -> list[tuple[str, str]]:
    """``(command, expected output)`` pairs of a console transcript."""
    out: list[tuple[str, str]] = []
    lines = code.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        assert lines[i].startswith("$ "), lines[i]
        command = lines[i][2:]
        while command.endswith("\\"):
            i += 1
            command += "\n" + lines[i]
        i += 1
        expected = []
        while i < len(lines) and not lines[i].startswith("$ "):
            expected.append(lines[i])
            i += 1
        out.append((command, "\n".join(expected)))
    return out


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "transcript"], ids=lambda b: b.id)
def test_transcript_is_real_output(block, tmp_path):
    block.skip_if_unavailable()
    SETUPS[block.setup or ""](tmp_path) if block.setup else None
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    for name in ("NO_COLOR", "FORCE_COLOR", "DSDMERGE_TRACEBACK"):
        env.pop(name, None)
    bindir = tmp_path / "bin"  # `dsdmerge` is this checkout, whatever is installed
    bindir.mkdir()
    (bindir / "dsdmerge").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m dsdmerge "$@"\n')
    (bindir / "dsdmerge").chmod(0o755)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    commands = _commands(block.code)
    assert commands
    for command, expected in commands:
        proc = subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
        )
        assert proc.stdout.rstrip("\n") == expected, f"$ {command}\n{proc.stdout}"


# -- test modules: pytest blocks are imported as the test modules a user would save ------


PYTEST_BLOCKS = [b for b in ALL if b.kind == "pytest"]


def load(code: str, directory: Path, name: str) -> ModuleType:
    """Import ``code`` as the test module a user would save it as."""
    path = directory / f"{name}.py"
    path.write_text(code, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


TESTS = [
    (block, name)
    for block in PYTEST_BLOCKS
    for name in sorted(set(re.findall(r"^def (test_\w+)", block.code, re.M)))
]


def test_every_test_module_has_tests():
    assert PYTEST_BLOCKS
    for block in PYTEST_BLOCKS:
        assert any(b is block for b, _ in TESTS), block.id


@pytest.mark.parametrize(("block", "name"), TESTS, ids=lambda x: getattr(x, "id", x))
def test_docs_test_module_passes(block, name, tmp_path):
    block.skip_if_unavailable()
    module = load(block.code, tmp_path, "test_docs_example")
    getattr(module, name)()


def _fuzz_example() -> Block:
    found = [b for b in PYTEST_BLOCKS if "def resume_optimizer_state(" in b.code]
    assert len(found) == 1, "the docs lost the fuzz-your-resume-path example"
    return found[0]


def test_the_fuzz_example_can_fail(tmp_path):
    """It asserts something real: a resume step that drops a trained value fails it."""
    original = _fuzz_example().code
    code = original.replace(
        'return dsdmerge.merge(loaded, fresh, policy="warn", allow_missing=["*.indexer.*"])',
        "merged = dsdmerge.merge(loaded, fresh)\n"
        "    return {**merged, next(iter(loaded)): None}  # loses one trained value",
    )
    assert code != original
    module = load(code, tmp_path, "test_docs_fuzz_example_broken")
    with pytest.raises(AssertionError):
        module.test_resume_keeps_every_trained_value_and_one_lr_per_group()


def test_a_block_that_misses_an_import_fails(tmp_path, monkeypatch):
    """The setups give objects, never imports: the README's blocks must bring their own."""
    chain = next(c for c in _chains() if "loaded = torch.load(path" in c[0].code)
    broken = dataclasses.replace(chain[0], code=chain[0].code.replace("import torch\n", "", 1))
    assert broken.code != chain[0].code
    with pytest.raises(NameError, match="torch"):
        test_python_block_runs([broken], tmp_path, monkeypatch)
