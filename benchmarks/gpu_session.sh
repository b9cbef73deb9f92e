#!/usr/bin/env bash
# The GPU checks of issues 32 and 41 in ONE call of at most 9 minutes (BUDGET seconds, default 530) on
# a fresh single-GPU machine, the deciding steps first:
#  1. decoding on a llama-1b trained in the same run to memorize the batch (peaked logits), bf16, batch
#     256, 32 + 32: HF generate, the verified static decode extraction now runs (issue 41 item 3:
#     >= 2x HF generate, tokens equal), greedy_generate, the bare compiled decode, HF static generate;
#  2. the engine's training step at 1,1,1,1 with both switches beside HF + per-block compile, batch 4
#     and 8 (llama-1b shape, seq 2048, bf16), each with one profiled step (kernel time by family: what
#     the remaining gap is made of; issue 41 items 2 and 4);
#  3. the GPU-marked tests, and the LM head alone (full logits / chunked per-token / chunked sum, llama-1b's
#     head over 4 x 2048 tokens in bf16);
#  4. the other peer arms (engine as is / + chunked head / + compile; HF eager, HF + Liger (+ compile)
#     when liger-kernel is carried) and decoding on the random-init model, as the budget allows.
# One table at the end. Every step is time-limited (`timeout`) and no step starts past the budget.
#
#   bash benchmarks/gpu_session.sh [OUT_DIR]          # FULL=1 adds issue 21's older checks at the end
#
# Without CUDA it runs the same steps as a dry run on CPU (tiny shape, aot_eager/eager compile
# backends, a forced small chunk): numbers meaningless, code paths end to end.
#
# The machine needs torch (CUDA), transformers, safetensors, pyyaml, tqdm, pytest. What it lacks is
# installed from wheels in .whl/ when that folder exists (carry it with the run tool):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d .whl gensim==4.4.0 smart-open==9.0.2 nltk==3.10.4 defusedxml==0.7.1 liger-kernel==0.8.5
#   pip wheel --no-deps rouge-score==0.1.2 -w .whl
#   pip download --no-deps datasketch==2.0.0 -d .whl   (pure Python; imported only by near-dedup)
# (30 MB; liger-kernel only for the two Liger arms; without it they print "skipped"). The image had
# transformers 5.17.0 and torch 2.11 (2026-11): the dry run below passes under transformers 5.17.0 too.
# W&B is switched off (WANDB_MODE=disabled): it is not on the machine and nothing here needs it.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/gpu_session}}
BUDGET=${BUDGET:-530}
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

step() {  # step NAME SECONDS COMMAND...: run with a time limit (cut to the budget left), log, record
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - SECONDS - 5))
  if [ "$left" -lt 15 ]; then
    echo "=== $name: not started (budget of ${BUDGET}s spent)" | tee -a "$LOG"
    SUMMARY+=("$(printf '%-22s not started (budget)' "$name")")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v -E "it/s\]|step/s\]|req/s\]|FutureWarning|return forward_call" \
    | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  SUMMARY+=("$(printf '%-22s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}
SUMMARY=()

if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  DRY=0
  PEERS="--model llama-1b --seq 2048 --batches 4,8 --steps 6 --warmup 2"
  DECODE="--model llama-1b --batch 256 --prefix 32 --new 32 --reps 3"
  TRAINED="--train ${TRAIN_STEPS:-150} --lr 1e-3"
  EAGER_S=75 COMPILE_S=120 DECODE_S=110 TRAINED_S=200
else
  DRY=1
  echo "no CUDA device: dry run on CPU (tiny shapes; the figures mean nothing)" | tee -a "$LOG"
  PEERS="--device cpu --model tiny --seq 64 --batches 2,4 --steps 1 --warmup 1 --backend aot_eager --loss-chunk 32"
  DECODE="--device cpu --model tiny --batch 4 --prefix 8 --new 4 --reps 1 --backend eager"
  TRAINED="--train 30 --lr 1e-2"
  EAGER_S=180 COMPILE_S=300 DECODE_S=300 TRAINED_S=300
  BUDGET=${DRY_BUDGET:-1500}
fi

step env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null;
  python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
  transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else \"cpu\")"'
P=benchmarks/bench_peers.py
D=benchmarks/bench_decode.py
# the steps that decide issue 41 first: decoding on a trained model, then the engine with both
# switches vs the best HF peer (each profiled), then the GPU tests, then the rest
step decode-trained "$TRAINED_S" python3 $D $DECODE $TRAINED \
  --arms hf_generate,static_verified,static_gated,greedy_generate,static_compiled,hf_static --out "$OUT/trained"
for arm in engine+both hf+compile; do
  step "peer-$arm" "$COMPILE_S" python3 $P --arm "$arm" $PEERS --profile --out "$OUT"
done
if [ "$DRY" = 0 ]; then
  step pytest-gpu 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_speed.py
  step chunked-head 60 python3 benchmarks/bench_chunked_head.py --device cuda --tokens 8192 --hidden 2048 \
    --vocab 128256 --reps 10 --out "$OUT/chunked_head.json"
fi
for arm in engine hf engine+compile engine+chunked hf+liger+compile hf+liger; do
  case $arm in *compile|*both) lim=$COMPILE_S ;; *) lim=$EAGER_S ;; esac
  step "peer-$arm" "$lim" python3 $P --arm "$arm" $PEERS --out "$OUT"
done
step decode-random "$DECODE_S" python3 $D $DECODE --out "$OUT"
if [ "${FULL:-0}" = 1 ]; then  # issue 21's checks (each within the same budget)
  B=benchmarks/bench_gpu.py
  step vs-torch 120 python3 $B --vs-torch --model llama-1b --seq 2048 --batch 4 --reps 10 --profile \
    --out "$OUT/gpu_vs_torch.json"
  step bf16-check 60 python3 $B --bf16-check --steps 20 --out "$OUT/gpu_bf16.json"
  T="torchrun --nproc-per-node 1 -m memorization train configs/train/tiny-wiki.yaml --grid 1,1,1,1"
  step torchrun-train 120 bash -c "rm -rf /tmp/gpu_train && $T trainer.checkpoint_every=250 --out /tmp/gpu_train \
    && ls /tmp/gpu_train /tmp/gpu_train/checkpoints /tmp/gpu_train/model && tail -2 /tmp/gpu_train/metrics.jsonl"
  step extraction 80 python3 benchmarks/bench_extraction.py --device cuda --reps 5 --out "$OUT/extraction.json"
fi

echo "=== peer table" | tee -a "$LOG"
python3 $P --table "$OUT" 2>&1 | tee -a "$LOG"
echo "=== summary (${SECONDS}s of ${BUDGET}s)" | tee -a "$LOG"
printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
grep -h -E "^(peer_|decode_|gpu_|extraction_)[a-z_0-9]*: " "$LOG" | tee -a "$LOG"
