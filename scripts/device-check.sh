#!/usr/bin/env bash
# The accelerator checks as one short run on a CUDA (or Ascend) host, e.g. a lent H200:
#
#   bash scripts/device-check.sh          # log also in ${OUT:-/tmp}/device-check.log
#
# It uses the host's own python3 and torch build (the project goes on PYTHONPATH, nothing is
# installed) and runs only the tests marked `cuda` / `npu`. Each marker says how many devices its
# test needs (NCCL between two ranks needs two GPUs: NCCL refuses two ranks of one communicator on
# one GPU); the tests this host cannot run are listed as NOT RUN, with the reason. On CUDA it then
# takes the monolithic generation figures (`afd bench generate --device cuda:0`).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 AFD_NUM_THREADS="${AFD_NUM_THREADS:-4}"
log="${OUT:-/tmp}/device-check.log"
{
    nvidia-smi -L 2>/dev/null || true
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
    timeout "${DEVICE_CHECK_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -m "cuda or npu" tests
    status=$?
    if python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then  # GPU figures for benchmarks.md
        timeout 120 python3 -m afd.cli.main bench generate --synthetic deepseek-v2-lite --device cuda:0 --runs 3
        timeout 60 python3 -m afd.cli.main bench generate --device cuda:0 --runs 3
    fi
    exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
