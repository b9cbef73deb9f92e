#!/usr/bin/env bash
# Everything the GPU checks need, in one call of at most 10 minutes on a fresh single-GPU machine
# (issue 21): throughput/MFU/memory, engine vs plain PyTorch, bf16 equality, the GPU-marked tests,
# a torchrun (NCCL) training run with checkpoint and export, extraction vs HF generate.
#
#   bash benchmarks/gpu_session.sh [OUT_DIR]
#
# The machine needs torch (CUDA), transformers, peft, safetensors, scikit-learn, matplotlib, pyyaml,
# tqdm, pytest. What it lacks (gensim for the bundled corpora, rouge-score + nltk for evals.metrics,
# smart-open for gensim) is installed from wheels in .whl/ when that folder exists:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .whl gensim==4.4.0 smart-open==9.0.2 nltk==3.10.4 ; pip wheel --no-deps rouge-score==0.1.2 -w .whl
# W&B is switched off (WANDB_MODE=disabled): it is not on the machine and nothing here needs it.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/gpu_session}}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, record the status
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v -E "it/s\]|step/s\]|req/s\]" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  SUMMARY+=("$(printf '%-22s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}
SUMMARY=()

step env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv;
  python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
  transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"'
B=benchmarks/bench_gpu.py
step mfu-b4 110 python3 $B --model llama-1b --seq 2048 --batch 4 --out "$OUT/gpu_b4.json"
step mfu-b8-ckpt 110 python3 $B --model llama-1b --seq 2048 --batch 8 --checkpoint --out "$OUT/gpu_b8_ckpt.json"
step vs-torch 120 python3 $B --vs-torch --model llama-1b --seq 2048 --batch 4 --reps 10 --profile \
  --out "$OUT/gpu_vs_torch.json"
step bf16-check 60 python3 $B --bf16-check --steps 20 --out "$OUT/gpu_bf16.json"
step pytest-gpu 100 python3 -m pytest -m gpu -q -p no:cacheprovider $(grep -l "mark.gpu" tests/test_*.py)
T="torchrun --nproc-per-node 1 -m memorization train configs/train/tiny-wiki.yaml --grid 1,1,1,1"
step torchrun-train 120 bash -c "rm -rf /tmp/gpu_train && $T trainer.checkpoint_every=250 --out /tmp/gpu_train \
  && ls /tmp/gpu_train /tmp/gpu_train/checkpoints /tmp/gpu_train/model && tail -2 /tmp/gpu_train/metrics.jsonl"
step torchrun-resume 90 bash -c "rm -rf /tmp/gpu_resume && $T trainer.checkpoint_every=250 --out /tmp/gpu_resume \
  --resume /tmp/gpu_train/checkpoints/step-00000500 && tail -2 /tmp/gpu_resume/metrics.jsonl"
step extraction 80 python3 benchmarks/bench_extraction.py --device cuda --reps 5 --out "$OUT/extraction.json"

echo "=== summary" | tee -a "$LOG"
printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
grep -h -E "^(gpu_|extraction_)[a-z_0-9]*: " "$LOG" | tee -a "$LOG"
