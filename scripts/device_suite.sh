#!/usr/bin/env bash
# Every GPU figure of jaxloop in one command, from a source checkout, within ~8 minutes on one H200:
#
#   scripts/device_suite.sh [ANCHOR_PY] OUT_DIR
#
# ANCHOR_PY: a copy of shared/bench/looped_anchor.py (shared/ does not travel to the GPU machine:
# copy it into an ignored folder of the checkout and carry that folder), run in the same command
# so its PyTorch numbers sit beside ours. OUT_DIR receives one JSON file per figure and suite.log.
# Wheels of the packages the GPU image lacks (ml_collections, tensorboardX) are installed from .whl/
# when present: `scripts/device_wheels.sh` downloads them here; carry .whl.
#
# Steps (each bounded by `timeout`, each writing OUT_DIR/<name>.json; a failed step is logged and
# the suite goes on):
#   bench_model   fwd+bwd of the Nanbeige4.2-3B shape, 4 x 2048 tokens, bf16, plain and sharded
#                 (the trainer's path), remat none and full
#   anchor        looped_anchor.py: matmul ceiling, JAX cuDNN, torch eager / compile
#   decode        embedded sampler, batch 64, context 1024, per-loop KV
#   publish       policy publication stages at the 3B shape
#   e2e           scripts/e2e_official.py: 2 updates of each algorithm at the official shape
# Without a GPU the same steps run at tiny / reduced shapes (the CPU check of the script itself).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 2 ]; then ANCHOR=$1; OUT=$2; elif [ $# -eq 1 ]; then ANCHOR=""; OUT=$1; else
  echo "usage: scripts/device_suite.sh [ANCHOR_PY] OUT_DIR" >&2; exit 2; fi
mkdir -p "$OUT"
LOG="$OUT/suite.log"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/jaxloop-site .whl/*.whl && export PYTHONPATH=/tmp/jaxloop-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
GPU=$($PY -c "import jax; print(int(jax.default_backend() == 'gpu'))" 2>/dev/null || echo 0)
echo "suite: gpu=$GPU out=$OUT anchor=${ANCHOR:-none}" | tee "$LOG"

step() {  # step NAME SECONDS CMD...: run CMD, keep its last stdout line (the JSON) as NAME.json
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name: $*" | tee -a "$LOG"
  timeout "$limit" "$@" > "$OUT/$name.out" 2>> "$LOG"
  local code=$?
  tail -n 1 "$OUT/$name.out" > "$OUT/$name.json"
  cat "$OUT/$name.out" >> "$LOG"
  rm -f "$OUT/$name.out"
  echo "== $name: exit $code in $((SECONDS - start)) s" | tee -a "$LOG"
}

if [ "$GPU" = 1 ]; then
  for remat in none full; do
    for path in plain sharded; do
      step "bench_model_${path}_remat_${remat}" 150 $PY scripts/bench_model.py \
        --config nanbeige-3b --batch 4 --seq 2048 --dtype bfloat16 --remat "$remat" \
        --attention cudnn --steps 5 --path "$path"
    done
  done
  if [ -n "$ANCHOR" ]; then
    echo "== anchor" | tee -a "$LOG"
    OUT="$OUT" RESULT_FILE=anchor.json ONLY=jmm,jax_cudnn,tmm,torch_eager,torch_compile \
      timeout 240 $PY "$ANCHOR" >> "$LOG" 2>&1
    echo "== anchor: exit $?" | tee -a "$LOG"
  fi
  step decode 120 $PY scripts/bench_decode.py --config nanbeige-3b --batch 64 --context 1024
  # naive + staged (first and 2 reused) + serialise + verify + disk of 8.3 GB: host-bound stages
  step publish 180 $PY scripts/bench_publish.py --layers 22 --hidden 3072 --vocab 166144 \
    --repeats 2
  step e2e 600 $PY scripts/e2e_official.py --config nanbeige-3b
else
  step bench_model_plain 300 $PY scripts/bench_model.py --config tiny --batch 2 --seq 64 \
    --dtype float32 --steps 3 --path plain
  step bench_model_sharded 300 $PY scripts/bench_model.py --config tiny --batch 2 --seq 64 \
    --dtype float32 --steps 3 --path sharded
  if [ -n "$ANCHOR" ]; then
    echo "== anchor: needs a GPU (torch.compile, cuDNN); skipped on CPU" | tee -a "$LOG"
  fi
  step publish 120 $PY scripts/bench_publish.py --layers 1 --hidden 256 --vocab 1024 --repeats 2
  step e2e 1200 $PY scripts/e2e_official.py --config nanbeige-3b --reduced --algorithms grpo
fi
echo "suite done: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$LOG"
