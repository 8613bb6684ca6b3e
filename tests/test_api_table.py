"""The table of the public namespace in ``docs/api.md`` lists exactly what is exported.

Every name of ``__all__`` in ``dsdmerge``, ``dsdmerge.integrations``,
``dsdmerge.integrations.lightning`` and ``dsdmerge.strategies`` has one row, no row names
anything else, each row's kind is what the object is, and each row links to a page that exists.
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
NAMESPACES = (
    "dsdmerge",
    "dsdmerge.integrations",
    "dsdmerge.integrations.lightning",
    "dsdmerge.strategies",
)
KINDS = ("function", "class", "type", "constant", "preset", "exception", "warning")
ROW = re.compile(
    r"^\| `(?P<ns>[\w.]+)` \| `(?P<name>\w+)` \| (?P<kind>\w+) \| (?P<what>[^|]+?) "
    r"\| \[[^\]]+\]\((?P<link>[^)]*)\) \|$"
)


def _table() -> list[re.Match[str]]:
    text = API.read_text(encoding="utf-8")
    start = text.index("<!-- public-namespace: start -->")
    end = text.index("<!-- public-namespace: end -->")
    lines = text[start:end].splitlines()[3:]  # the marker, the header and its rule
    rows = [ROW.match(line) for line in lines if line.strip()]
    bad = [line for line, row in zip(lines, rows, strict=False) if row is None]
    assert not bad, f"rows of docs/api.md's table that do not parse: {bad}"
    return [row for row in rows if row is not None]


def _kind(name: str, obj: object) -> str:
    if typing.get_origin(obj) is typing.Literal:
        return "type"
    if inspect.isclass(obj):
        if issubclass(obj, Warning):
            return "warning"
        return "exception" if issubclass(obj, BaseException) else "class"
    if name.endswith("_PRESETS"):
        return "preset"
    return "function" if callable(obj) else "constant"


def test_the_table_lists_exactly_the_exported_names():
    listed = [(row["ns"], row["name"]) for row in _table()]
    exported = [(ns, name) for ns in NAMESPACES for name in importlib.import_module(ns).__all__]
    assert len(listed) == len(set(listed)), "a name is listed twice"
    missing = sorted(set(exported) - set(listed))
    extra = sorted(set(listed) - set(exported))
    assert not missing, f"exported but not in docs/api.md's table: {missing}"
    assert not extra, f"in docs/api.md's table but not exported: {extra}"


@pytest.mark.parametrize("row", _table(), ids=lambda row: f"{row['ns']}.{row['name']}")
def test_each_row_says_what_the_name_is(row):
    assert row["kind"] in KINDS, row["kind"]
    module = importlib.import_module(row["ns"])
    try:
        obj = getattr(module, row["name"])
    except ImportError:  # ResumeCallback is built on first access, from Lightning
        pytest.skip(f"{row['ns']}.{row['name']} needs a package that is not installed")
    assert row["kind"] == _kind(row["name"], obj)
    page, _, anchor = row["link"].partition("#")
    assert (API.parent / page).is_file() if page else anchor, row["link"]
