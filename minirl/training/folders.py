"""A model folder written whole or not at all: saved under a temporary name beside `target` and renamed into place,
so a reader never sees a half-written folder and the loser of a race between two builders discards its copy."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def publish_folder(target: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temporary folder beside `target`, which then becomes `target` (unless another process
    made it meanwhile: then its copy stands and ours goes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another builder won the race
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
