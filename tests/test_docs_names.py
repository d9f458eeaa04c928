"""Every public name the docs spell `minirl.X.Y` (README, docs/, tutorials/, the notebooks) imports as
`from minirl.X import Y`: a reader who copies a name from the docs gets the thing it names."""
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "tutorials").glob("*.md")),
        *sorted((ROOT / "notebooks").glob("*.ipynb"))]
NAME = re.compile(r"(?<![\w./-])minirl(?:\.[A-Za-z_]\w*)+")


def doc_names() -> dict[str, str]:
    """Each dotted name -> the first doc that spells it (a trailing file suffix such as `.py`/`.md` is a path)."""
    found: dict[str, str] = {}
    for doc in DOCS:
        for m in NAME.finditer(doc.read_text(encoding="utf-8")):
            name = m.group(0)
            if name.rsplit(".", 1)[-1] in ("py", "md", "yaml", "json", "jsonl", "ipynb", "png", "toml"):
                continue
            found.setdefault(name, doc.name)
    return found


def test_the_docs_spell_some_names():
    assert {"minirl.sandbox", "minirl.sync.receiver.AdapterReceiver"} <= set(doc_names())


def _check(name: str, where: str) -> None:
    parts = name.split(".")
    k = len(parts) - 1  # the longest prefix that is a module; the rest are attributes (minirl.Config.from_yaml)
    while k > 1 and importlib.util.find_spec(".".join(parts[:k])) is None:
        k -= 1
    parent, leaf = ".".join(parts[:k]), parts[k]
    module = importlib.import_module(parent)
    assert hasattr(module, leaf) or importlib.util.find_spec(f"{parent}.{leaf}") is not None, f"{where}: {name}"
    exec(f"from {parent} import {leaf}", {})  # `from minirl.X import Y`
    obj = getattr(module, leaf, None)
    for attr in parts[k + 1:]:
        assert hasattr(obj, attr), f"{where}: {name} ({attr} is not an attribute of {obj!r})"
        obj = getattr(obj, attr)


@pytest.mark.parametrize("name", sorted(doc_names()))
def test_a_name_in_the_docs_imports(name):
    _check(name, doc_names()[name])


def test_a_name_that_does_not_resolve_is_caught():
    _check("minirl.Config.from_yaml", "control")
    for bad in ("minirl.Config.no_such_method", "minirl.no_such_name", "minirl.sync.receiver.NoSuchClass"):
        with pytest.raises((AssertionError, ImportError)):
            _check(bad, "control")
