"""Private torch APIs are named in one module only (``dsdmerge/_torch_api.py``).

Every other module of the package is parsed: no attribute chain from ``torch`` reaches
a ``_private`` name, and no ``from torch... import`` names one or goes through a private
module. Names a pickle holds (strings) are not imports and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dsdmerge import _torch_api

PACKAGE = Path(__file__).resolve().parent.parent / "dsdmerge"


def _private(name: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in name.split("."))


def _chain(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def private_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            module = node.module or ""
            names = [a.name for a in node.names]
            if _private(module) or any(map(_private, names)):
                found.append(f"{path.name}:{node.lineno}: from {module} import {names}")
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain.startswith("torch.") and _private(chain):
                found.append(f"{path.name}:{node.lineno}: {chain}")
    return found


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "_torch_api.py"],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_no_module_but_torch_api_names_a_private_torch_api(path):
    assert private_uses(path) == []


def test_the_checker_sees_private_names():
    source = PACKAGE / "_torch_api.py"
    uses = private_uses(source)
    assert any("_get_fqns" in u for u in uses), uses
    assert any("_weights_only_unpickler" in u for u in uses), uses


def test_every_private_api_has_its_answer_on_this_torch():
    assert _torch_api.torch_version() >= _torch_api.MIN_TORCH
    assert _torch_api.storage_info_class().__name__ == "_StorageInfo"
    fields = _torch_api.tensor_properties_fields()
    assert fields[:5] == _torch_api.TENSOR_PROPERTIES_BASE
    assert ("strides" in fields) == (_torch_api.torch_version() >= (2, 15))
    assert "torch.Size" in _torch_api.weights_only_allowed_globals()
    assert _torch_api.get_fqns(torch.nn.Linear(1, 1), "weight") == {"weight"}


def test_the_floor_is_the_same_everywhere():
    import re

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    root = PACKAGE.parent
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(d for d in deps if d.startswith("torch"))
    assert floor == "torch>={}.{}".format(*_torch_api.MIN_TORCH), floor
    matrix = (root / ".ci" / "torch-matrix").read_text()
    releases = re.search(r"^ALL=\((.*)\)$", matrix, re.M).group(1).split()
    minors = [tuple(map(int, r.split(".")[:2])) for r in releases]
    assert minors[0] == _torch_api.MIN_TORCH, releases
    assert minors == sorted(set(minors)), "one release per minor, oldest first"
    corpus = sorted(
        # (torch-2.13-py3.11.2: written by that torch under another Python)
        tuple(map(int, p.name.removeprefix("torch-").split("-")[0].split(".")))
        for p in (root / "tests" / "corpus").glob("torch-*")
    )
    assert minors[-1] == corpus[-1], (releases, corpus)
    assert "bash .ci/torch-matrix --ends" in (root / ".ci" / "run").read_text()
