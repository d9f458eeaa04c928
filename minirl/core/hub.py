"""Whether the Hugging Face Hub can be reached, found out within seconds: a model id (`training.models`) and an
`hf:` dataset (`data.sources`) that are not in the local cache fail in one line at once when it cannot."""
from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

from huggingface_hub import constants


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connect within `timeout_s` (name lookup included: it runs in a
    thread of its own, since `getaddrinfo` has no timeout of its own)."""
    url = urlsplit(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                     timeout_s).close()
            ok.append(True)
        except OSError:
            pass
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout_s + 0.5)
    return bool(ok)
