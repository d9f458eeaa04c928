"""The config as people meet it outside Python: one CLI flag per field, and each field's docstring (the CLI help
and the config reference)."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
from functools import lru_cache
from typing import Any, Sequence

import yaml

from minirl.config.fields import Config


@lru_cache(maxsize=None)
def field_docs() -> dict[str, str]:
    """The docstring under each field, read from the source (used for CLI help and the docs)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(Config)))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = b.value.value
    return docs


@lru_cache(maxsize=None)
def field_sections() -> dict[str, str]:
    """The section each field sits under in `fields.py` (its `# --- name ---` comment): the groups of the CLI help
    and of docs/config.md."""
    lines, _ = inspect.getsourcelines(Config)
    names = {f.name for f in dataclasses.fields(Config)}
    out, section = {}, ""
    for line in lines:
        head = re.match(r"\s*# --- (.+?) -+\s*$", line)
        if head:
            section = head.group(1)
        field = re.match(r"\s*(\w+):", line)
        if field and field.group(1) in names:
            out[field.group(1)] = section
    return out


def _parse_value(text: str) -> Any:
    v = yaml.safe_load(text)
    if isinstance(v, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            return float(v)
        except ValueError:
            pass
    return v


def add_cli_args(parser: argparse.ArgumentParser, defaults: Config | None = None) -> None:
    """One `--flag` per field; values are parsed as YAML scalars/lists (`--target-modules "[q_proj,v_proj]"`)."""
    docs, sections = field_docs(), field_sections()
    defaults = defaults or Config()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(Config):
        section = sections[f.name]
        group = groups.get(section) or groups.setdefault(section, parser.add_argument_group(f"config: {section}"))
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=_parse_value, default=argparse.SUPPRESS,
                            metavar="X",
                            help=f"{docs.get(f.name, '')} (default: {getattr(defaults, f.name)!r})".replace("%", "%%"))


def dashed(argv: Sequence[str]) -> list[str]:
    """`argv` with each Config flag spelt with underscores (`--model_kwargs`, as the field is named in YAML and
    docs/config.md) written as its flag (`--model-kwargs`): every spelling of a field parses."""
    names = {f.name for f in dataclasses.fields(Config)}
    out = []
    for a in argv:
        flag, eq, value = a.partition("=")
        if flag.startswith("--") and "_" in flag and flag[2:] in names:
            a = "--" + flag[2:].replace("_", "-") + eq + value
        out.append(a)
    return out


def overrides_from_args(ns: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(ns, f.name) for f in dataclasses.fields(Config) if hasattr(ns, f.name)}
