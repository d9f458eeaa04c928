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


@pytest.mark.parametrize("name", sorted(doc_names()))
def test_a_name_in_the_docs_imports(name):
    parent, _, leaf = name.rpartition(".")
    module = importlib.import_module(parent)  # `from minirl.X import Y`
    assert hasattr(module, leaf) or importlib.util.find_spec(name) is not None, f"{doc_names()[name]}: {name}"
    exec(f"from {parent} import {leaf}", {})
