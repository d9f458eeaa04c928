#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index (the lent GPU image): minirl's required packages that
# `import minirl` needs beyond torch, transformers, peft and accelerate (and their own dependencies), built for the
# image's Python. The image was last seen (2026-12-04) with Python 3.12, torch 2.11, transformers 5.17, peft and
# accelerate; whether it has matplotlib, ipywidgets and cloudpickle is not known (minirl imported them lazily then;
# since 2a66cce they are imported at the top, so `import minirl`, and every gpu_check section but `env`, needs them),
# nor whether it has pytest and pytest-xdist (pyproject's addopts pass `-n 2`), which running the tests there needs.
#   bash scripts/gpu_wheels.sh            # here, with an index: ./gpu_wheels (git-ignored, ~37 MB)
# On the GPU machine (the folder carried there; the repository root) gpu_check.sh installs them where `import minirl`
# fails; by hand, installed only where something is missing:
#   python3 -c "import minirl, pytest, xdist" 2>/dev/null ||
#     python3 -m pip install -q --no-index --no-deps --target /tmp/deps gpu_wheels/*.whl
#   export PYTHONPATH=/tmp/deps; bash scripts/gpu_check.sh     # and python3 -m pytest ... likewise
set -euo pipefail
cd "$(dirname "$0")/.."
pyver="${PYVER:-3.12}"
py="${PYTHON:-python3}"
[[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && py=.venv/bin/python
rm -rf gpu_wheels
"$py" -m pip download -q --only-binary=:all: --implementation cp --python-version "$pyver" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d gpu_wheels "matplotlib>=3.8" "ipywidgets>=8.0" "cloudpickle>=3.0" "pytest>=8" "pytest-xdist>=3.6"
# what the image has already (torch, transformers and accelerate require them): the image's own copies stay in use
rm -f gpu_wheels/numpy-* gpu_wheels/packaging-* gpu_wheels/typing_extensions-* gpu_wheels/psutil-*
du -sh gpu_wheels
