#!/usr/bin/env bash
# The GPU check: minirl's GPU-only paths in one short run (< 8 minutes on one GPU), one JSON in $OUT or ./gpu_check_out.
#   bash scripts/gpu_check.sh             # GPU machine: synthetic 1.5B in bf16, CUDA IPC, NCCL (2+ GPUs), vLLM/QLoRA if installed
#   bash scripts/gpu_check.sh --cpu-twin  # the same code on CPU: tiny model, shared memory, gloo, float32
#   bash scripts/gpu_check.sh --only train,ipc   # some sections; each has its own time bound (BOUNDS in gpu_check.py)
# It installs nothing: minirl runs from this checkout (PYTHONPATH) with the machine's packages, and each section
# that needs a missing one reports `skipped: <package> not installed`.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
py="${PYTHON:-python3}"
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && py=.venv/bin/python
# the wheels of scripts/gpu_wheels.sh, carried here, where `import minirl` fails (the lent image may lack matplotlib,
# ipywidgets, cloudpickle): installed offline into a scratch folder, nothing else touched
if [[ -d gpu_wheels ]] && ! "$py" -c "import minirl" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --target /tmp/minirl-gpu-deps gpu_wheels/*.whl &&
    export PYTHONPATH="$PYTHONPATH:/tmp/minirl-gpu-deps"
fi
exec timeout 480 "$py" scripts/gpu_check.py "$@"
