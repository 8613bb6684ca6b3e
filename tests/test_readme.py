"""The README's "Fuzz your resume path" example is run as written, so it cannot rot."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def fuzz_section_code() -> str:
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## Fuzz your resume path\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README.md lost its 'Fuzz your resume path' section"
    blocks = re.findall(r"^```python\n(.*?)^```$", section.group(1), re.M | re.S)
    assert len(blocks) == 1, "the section should hold exactly one python example"
    return blocks[0]


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


TEST_NAMES = sorted(set(re.findall(r"^def (test_\w+)", fuzz_section_code(), re.M)))


def test_the_example_has_tests():
    assert len(TEST_NAMES) >= 2


@pytest.mark.parametrize("name", TEST_NAMES)
def test_readme_fuzz_example_passes(name, tmp_path):
    module = load(fuzz_section_code(), tmp_path, "test_readme_fuzz_example")
    getattr(module, name)()


def test_the_readme_example_can_fail(tmp_path):
    """It asserts something real: a resume step that drops a trained value fails it."""
    code = fuzz_section_code().replace(
        'return dsdmerge.merge(loaded, fresh, policy="warn", allow_missing=["*.indexer.*"])',
        "merged = dsdmerge.merge(loaded, fresh)\n"
        "    return {**merged, next(iter(loaded)): None}  # loses one trained value",
    )
    assert code != fuzz_section_code()
    module = load(code, tmp_path, "test_readme_fuzz_example_broken")
    with pytest.raises(AssertionError):
        module.test_resume_keeps_every_trained_value_and_one_lr_per_group()
