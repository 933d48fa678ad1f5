"""Every script in scripts/profile is a maintained tool: it imports against the library as it is, runs nothing on
import, and is listed in the folder's README."""

import importlib.util
import sys
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[1] / "scripts" / "profile"
SCRIPTS = sorted(FOLDER.glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_imports_and_is_indexed(path, monkeypatch):
    monkeypatch.syspath_prepend(str(FOLDER))  # the scripts import their shared helper, kernel_table, as a sibling
    spec = importlib.util.spec_from_file_location(f"profile_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    if path.stem != "kernel_table":
        assert callable(getattr(module, "main", None)), f"{path.name} has no main() (it must run nothing on import)"
    assert f"`{path.name}" in (FOLDER / "README.md").read_text(), f"{path.name} is not in scripts/profile/README.md"
