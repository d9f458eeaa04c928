"""Environment variables set for the length of a block, then put back as they were: what NCCL reads while a
communicator is built, and what the processes minirl starts inherit (their devices), without changing the
trainer's own environment for the rest of the run."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Mapping


@contextmanager
def environ(env: Mapping[str, str], keep_set: bool = False) -> Iterator[None]:
    """`env` in os.environ while the block runs, then each variable as it was (unset again if it was unset).
    `keep_set`: a variable the user already set keeps the user's value (NCCL settings: the user's win)."""
    names = [k for k in env if not (keep_set and k in os.environ)]
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update({k: env[k] for k in names})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
