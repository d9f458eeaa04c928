#!/usr/bin/env bash
# The GPU check: minirl's GPU-only paths in one short run (<= 8 minutes on one GPU), JSON in $OUT or ./gpu_check_out.
#   bash scripts/gpu_check.sh             # GPU machine: CUDA IPC, NCCL (2+ GPUs), bf16 trainer, vLLM tests if installed
#   bash scripts/gpu_check.sh --cpu-twin  # the same code on CPU: shared memory, gloo, float32
# On a bare machine with torch it installs what it needs from the package index when it can; without network it
# runs with what is there (minirl from this checkout via PYTHONPATH) and each section says what it skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && py=.venv/bin/python
need=$("$py" - <<'PY'
import importlib.util as u
print(" ".join(p for m, p in [("transformers", "transformers>=4.56"), ("peft", "peft>=0.17"), ("gguf", "gguf>=0.10"),
      ("yaml", "pyyaml"), ("cloudpickle", "cloudpickle"), ("datasets", "datasets>=3.0"), ("psutil", "psutil"),
      ("tqdm", "tqdm"), ("matplotlib", "matplotlib"), ("pytest", "pytest")] if u.find_spec(m) is None))
PY
)
if [[ -n "$need" ]]; then
  echo "gpu_check: installing $need"
  "$py" -m pip install -q $need || echo "gpu_check: could not install ($need); sections that need them will say so"
fi
exec timeout 480 "$py" scripts/gpu_check.py "$@"
