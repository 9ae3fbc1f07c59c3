"""One Registry type (issue 70, part 4): every table that a later chapter fills is a
features.Registry declared in features.REGISTRIES, which names the module that fills
each key. A key's module is imported when the key is first asked for, and counted as
loaded only once it imported without error (before: a registry was marked loaded
before its import, so a failed import left it half-filled for good)."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from minillm import features
from minillm.features import REGISTRIES, Registry

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"
FILLS = ("update", "append", "add", "setdefault")


def filled_from_elsewhere() -> set[tuple[str, str]]:
    """(module, name) of every table a module fills (`T[k] = v`, `T.update(...)`, ...)
    that it imported from another minillm module."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        tree = ast.parse(path.read_text())
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = (".".join(parts[:len(parts) - node.level]
                                 + ((node.module,) if node.module else ()))
                        if node.level else node.module or "")
                for a in node.names:
                    imported[a.asname or a.name] = (base, a.name)
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Assign):
                target = next((t.value for t in node.targets
                               if isinstance(t, ast.Subscript)), None)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in FILLS):
                target = node.func.value
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                module = imported.get(target.value.id)  # sampling.SAMPLING_FIELDS
                if module and module[0] == "minillm":
                    out.add((f"minillm.{module[1]}", target.attr))
            elif isinstance(target, ast.Name) and target.id in imported:
                out.add(imported[target.id])
    return {(m, n) for m, n in out if m.startswith("minillm") and n.isupper()}


def test_every_table_filled_from_another_module_is_a_declared_registry():
    found = filled_from_elsewhere()
    assert len(found) >= 15, found
    for module, name in sorted(found):
        table = getattr(importlib.import_module(module), name)
        assert isinstance(table, Registry), (module, name, type(table))
        assert table.name == f"{module}.{name}" and table.name in REGISTRIES


def test_every_declared_key_is_registered_by_its_module():
    for name, declared in REGISTRIES.items():
        module, _, attr = name.rpartition(".")
        table = getattr(importlib.import_module(module), attr)
        assert isinstance(table, Registry) and table.name == name
        for key in (declared if isinstance(declared, dict) else ()):
            assert table[key] is not None or key == "bnb-int8", (name, key)
        assert len(dict(table.items())) == len(table)


def test_a_key_imports_only_its_module_and_a_failed_import_is_tried_again(
        monkeypatch, tmp_path):
    (tmp_path / "fills_a.py").write_text(
        "import os\nif os.environ.get('FAIL_ONCE'):\n"
        "    del os.environ['FAIL_ONCE']\n    raise ImportError('not yet')\n"
        "from minillm.features import REGISTRIES\nimport test_registry_table as t\n"
        "t.TABLE['a'] = 1\n")
    (tmp_path / "fills_b.py").write_text(
        "import test_registry_table as t\nt.TABLE['b'] = 2\n")
    (tmp_path / "test_registry_table.py").write_text(
        "from minillm.features import Registry\nTABLE = Registry('test_registry_table.TABLE')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(REGISTRIES, "test_registry_table.TABLE",
                        {"a": "fills_a", "b": "fills_b"})
    monkeypatch.setenv("FAIL_ONCE", "1")
    table = importlib.import_module("test_registry_table").TABLE
    assert list(table) == ["a", "b"] and "a" in table  # nothing imported yet
    assert "fills_a" not in sys.modules and "fills_b" not in sys.modules
    with pytest.raises(ImportError, match="not yet"):
        table["a"]
    assert table["a"] == 1  # tried again, not left half-filled
    assert "fills_b" not in sys.modules  # only the key's module
    assert dict(table.items()) == {"a": 1, "b": 2}
    with pytest.raises(KeyError, match="'c' is not in test_registry_table.TABLE"):
        table["c"]
    assert features.Registry is Registry


def test_loading_a_model_imports_no_engine():
    """Chapter 2's load_model(folder), without quantization, imports nothing of the
    later chapters (before: the quantization registry imported chapter 5, chapter 7's
    kernels and through them the engine)."""
    out = subprocess.run([sys.executable, "-c", (
        "import sys\nfrom minillm.model.loader import load_model\n"
        "from minillm.utils import bundled_model_path\nload_model(bundled_model_path())\n"
        "print(sorted(m for m in sys.modules if m.startswith('minillm')))")],
        capture_output=True, text=True, check=True, cwd=PACKAGE.parent).stdout
    assert eval(out) == ["minillm", "minillm.features", "minillm.model", "minillm.model.config",
                         "minillm.model.gguf", "minillm.model.loader", "minillm.model.sources",
                         "minillm.model.transformer", "minillm.utils"]


def test_a_notebooks_own_copy_holds_only_what_it_is_given():
    """A chapter's notebook defines its registries again in its own namespace: such
    a copy is not the one the package module holds, so it imports nothing (before
    this rule, chapter 6's notebook copy of BLOCK_KEY_EXTRAS imported the appendix's
    module, which filled the package's table, and the copy's lookup failed)."""
    copy = Registry("minillm.kv.paged.BLOCK_KEY_EXTRAS")
    assert list(copy) == [] and "cache_salt" not in copy
    copy["x"] = 1
    assert dict(copy.items()) == {"x": 1}
    from minillm.kv.paged import BLOCK_KEY_EXTRAS
    assert "cache_salt" in BLOCK_KEY_EXTRAS and "x" not in BLOCK_KEY_EXTRAS
