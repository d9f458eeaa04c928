"""Where a benchmark's result goes: one JSON file in its out folder."""
from __future__ import annotations

import json
from pathlib import Path


def write_json(out: str | Path, name: str, result: dict) -> dict:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(json.dumps(result, indent=2))
    return result
