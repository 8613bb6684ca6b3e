"""The modules form layers: each imports only modules below it, and nothing dodges that.

``LAYERS`` lists every module of the package from the bottom up. Two checks:

* each module, imported in a fresh interpreter (a fork of one that has imported only
  third-party packages) where every dsdmerge module above it is blocked, imports;
* no import statement anywhere in a module (at the top or inside a function: a
  lazy import that dodges a cycle) names a module above it. Imports under
  ``if TYPE_CHECKING:`` are annotations, not dependencies, and are not counted.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dsdmerge"

LAYERS = [
    # foundations: errors, text, leaf values, policies, layouts, report text
    "dsdmerge.errors",
    "dsdmerge._gc",
    "dsdmerge._torch_api",
    "dsdmerge._paths",
    "dsdmerge._text",
    "dsdmerge._values",
    "dsdmerge.report",
    "dsdmerge.policy",
    "dsdmerge.layout",
    "dsdmerge._ids",
    # the records everything below the verbs produces
    "dsdmerge._records",
    # layout conversions as data: key templates, the conversion records
    "dsdmerge._templates",
    "dsdmerge._conversions",
    # the engine, one module per concept
    "dsdmerge._trees",
    "dsdmerge._table",
    "dsdmerge._keys",
    "dsdmerge._tensors",
    "dsdmerge._groups",
    "dsdmerge._flat_pass",
    "dsdmerge._nested_walk",
    "dsdmerge._engine",
    "dsdmerge._spec",
    # the public verbs
    "dsdmerge.flatten",
    "dsdmerge.rename",
    "dsdmerge.resize",
    "dsdmerge.rekey",
    # layout conversions: one parameter's values, then whole state dicts
    "dsdmerge._convert_ops",
    "dsdmerge._convert_parts",
    "dsdmerge.convert",
    "dsdmerge.diff",
    # one merge: the options, the verdict, the pipeline; the public functions
    "dsdmerge._options",
    "dsdmerge._verdict",
    "dsdmerge._pipeline",
    "dsdmerge.merge",
    "dsdmerge.strategies",
    # integrations
    "dsdmerge.integrations._files",
    "dsdmerge.integrations._trust",
    "dsdmerge.integrations._view",
    "dsdmerge.integrations._dcp_metadata",
    "dsdmerge.integrations._dcp",
    "dsdmerge.integrations._fresh",
    "dsdmerge.integrations._optim",
    "dsdmerge.integrations.checkpoints",
    "dsdmerge.integrations._dcp_surgery",
    "dsdmerge.integrations.resume",
    "dsdmerge.integrations.hooks",
    "dsdmerge.integrations.lightning",
    "dsdmerge.integrations.writing",
    "dsdmerge.integrations.reference",
    "dsdmerge.integrations",
    # the package, the demo, the command line
    "dsdmerge",
    "dsdmerge.demo",
    "dsdmerge.cli",
    "dsdmerge.__main__",
]

# importing it runs the command line
NOT_IMPORTED = {"dsdmerge.__main__"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _imports(path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """``(module, line)`` per dsdmerge module an import statement names (not TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "dsdmerge"]
            found += [(name, node.lineno) for name in names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "dsdmerge":
                continue
            subs = [f"{node.module}.{a.name}" for a in node.names]
            named = [s for s in subs if s in modules]  # `from pkg import submodule`
            if len(named) < len(subs):  # some names are attributes of the module itself
                found.append((node.module, node.lineno))
            found += [(s, node.lineno) for s in named]
    return found


def test_the_layers_list_every_module_once():
    modules = _modules()
    assert len(LAYERS) == len(set(LAYERS))
    unknown = sorted(set(modules) - set(LAYERS))
    assert not unknown, f"place these modules in LAYERS (above everything they import): {unknown}"
    assert not set(LAYERS) - set(modules)


def test_no_import_statement_names_a_module_above_it():
    modules = _modules()
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for name, path in modules.items():
        for target, line in _imports(path, set(modules)):
            if target != name and rank[target] > rank[name]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not upward, "imports that reach up the layers:\n" + "\n".join(upward)


_CHILD = r"""
import importlib, importlib.abc, json, os, sys, types

layers, skip, package = json.loads(sys.argv[1])
import torch, numpy, optree, hypothesis  # third-party packages: imported once, before forking

failures = {}
for i, module in enumerate(layers):
    if module in skip:
        continue
    allowed = set(layers[: i + 1])
    pid = os.fork()
    if pid == 0:
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path, target=None):
                if fullname.split(".")[0] == "dsdmerge" and fullname not in allowed:
                    raise ImportError(f"{fullname} is above {module} in the layers")
                return None

        sys.meta_path.insert(0, Block())
        # a package below this module is imported for real; one above it is a bare namespace,
        # so that importing a submodule does not run the package's own imports
        packages = (("dsdmerge", package), ("dsdmerge.integrations", package + "/integrations"))
        for pkg, where in packages:
            if pkg not in allowed:
                stub = types.ModuleType(pkg)
                stub.__path__ = [where]
                sys.modules[pkg] = stub
        try:
            importlib.import_module(module)
        except BaseException as err:
            sys.stderr.write(f"{module}: {type(err).__name__}: {err}\n")
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        failures[module] = status
print(json.dumps(sorted(failures)))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="uses os.fork")
def test_each_module_imports_with_only_the_modules_below_it():
    args = json.dumps([LAYERS, sorted(NOT_IMPORTED), str(PACKAGE)])
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, done.stderr


def test_examples_use_the_library_not_the_command_line():
    """Examples show what a user's code calls: nothing from ``dsdmerge.cli``."""
    examples = PACKAGE.parent / "examples"
    modules = set(_modules())
    for path in sorted(examples.glob("*.py")):
        names = [name for name, _ in _imports(path, modules)]
        assert not [n for n in names if n.startswith("dsdmerge.cli")], path.name


def test_the_command_lines_errors_are_dsdmerge_errors():
    import dsdmerge as dm
    from dsdmerge import cli

    assert issubclass(cli.CLIError, dm.DSDMergeError)
    assert issubclass(dm.CheckpointWriteError, dm.DSDMergeError)
    assert issubclass(dm.CheckpointWriteError, OSError)
    from dsdmerge.integrations import writing

    with pytest.warns(DeprecationWarning, match="dsdmerge.integrations.writing.write_checkpoint"):
        old = cli.write_checkpoint
    assert old is writing.write_checkpoint


def test_the_merge_modules_old_internal_names_warn_and_still_work():
    import importlib

    import dsdmerge as dm

    merge_module = importlib.import_module("dsdmerge.merge")
    for name in ("apply_policy", "merge_resolved", "rename_hint", "reshaped"):
        with pytest.warns(DeprecationWarning, match=f"dsdmerge.merge.{name} is internal"):
            getattr(merge_module, name)
    with pytest.warns(DeprecationWarning, match="merge_resolved"):
        merge_resolved = merge_module.merge_resolved
    policy = dm.resolve_policy("warn")
    with pytest.warns(dm.DSDMergeWarning, match="missing from the checkpoint"):
        merged = merge_resolved({"a": 1}, {"a": 0, "b": 2}, policy, stacklevel=1)
    assert merged.state_dict == {"a": 1, "b": 2}
    assert merged.diff.missing == ("b",)
    with pytest.raises(AttributeError):
        merge_module.no_such_name  # noqa: B018


def test_backfill_takes_resume_optimizers_order_and_the_old_one_warns():
    import torch

    from dsdmerge.integrations import backfill_optimizer_state

    model = torch.nn.Linear(2, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saved = {
        "state": {0: {"momentum_buffer": torch.ones(1, 2)}},
        "param_groups": [{**optim.param_groups[0], "lr": 0.5, "params": [0, 1]}],
    }
    new = backfill_optimizer_state(optim, saved)
    with pytest.warns(DeprecationWarning, match=r"backfill_optimizer_state\(optimizer, loaded\)"):
        old = backfill_optimizer_state(saved, optim)  # type: ignore[arg-type]
    assert new.keys() == old.keys() == {"state", "param_groups"}
    assert new["param_groups"] == old["param_groups"]
    assert new["state"].keys() == old["state"].keys() == {0}
    assert new["state"][0]["momentum_buffer"] is old["state"][0]["momentum_buffer"]
