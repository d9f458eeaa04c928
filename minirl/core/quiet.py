"""Imported first by `minirl/__init__.py`, before anything that imports peft (which imports bitsandbytes where it
is installed): bitsandbytes warns on every AVX512-bf16 CPU that its optional 4-bit kernel (a Hugging Face Hub
download, out of reach offline) is missing; its built-in path runs."""
import logging

logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
