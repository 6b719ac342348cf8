#!/usr/bin/env bash
# One GPU session (the lent H100): install Transformer Engine and the project's wheels, then the GPU tests, the
# GEMM and rollout benchmarks and a GPU training run. Results land in $OUT (or ./gpu_out).
#   usage: bash benchmarks/gpu_session.sh [tests|gemm|rollout1k|rollout4k|train]...
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda PYTHONPATH=/tmp/site:$PWD
# installs survive on a warm machine: skip what is there
if ! python3 -c "import transformer_engine.jax" 2>/dev/null && [ -d .gpu/te/wheels ]; then
  bash .gpu/install_te.sh .gpu/te/wheels > "$OUT/te_install.log" 2>&1 || tail -20 "$OUT/te_install.log"
fi
if ! python3 -c "import ml_collections, grain, math_verify" 2>/dev/null && [ -d .gpu/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
fi
for what in "$@"; do
  case $what in
    tests) timeout 300 python3 -m pytest -q -m gpu tests -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    gemm) timeout 420 python3 -m fp8rl_jax.bench gemm --out "$OUT/gemm_h100.json" 2>&1 | grep -vi warn | tee "$OUT/gemm.log" | tail -3 ;;
    rollout1k) timeout 400 python3 -m fp8rl_jax.bench rollout --new_tokens 1024 --modes bf16,fp8,fp8_kv,fp8_te,fp8_kv_te \
        --out "$OUT/rollout_1k.json" 2>&1 | grep -vi warn | tee "$OUT/rollout_1k.log" | tail -12 ;;
    rollout4k) timeout 560 python3 -m fp8rl_jax.bench rollout --new_tokens 4096 --modes bf16,fp8_te,fp8_kv_te \
        --out "$OUT/rollout_4k.json" 2>&1 | grep -vi warn | tee "$OUT/rollout_4k.log" | tail -8 ;;
    train) for mode in fp8_e2e bf16; do
        timeout 240 python3 -m fp8rl_jax.main --config=configs/tiny.py:$mode --config.precision.backend=te \
          --config.workdir="$OUT/tiny_te_$mode" --config.logging.progress=False --config.logging.tensorboard=False \
          --config.logging.plots=False > "$OUT/train_$mode.log" 2>&1; tail -3 "$OUT/train_$mode.log"
        python3 -c "import json,sys; r=[json.loads(l) for l in open('$OUT/tiny_te_$mode/metrics.jsonl')]; print('$mode', [round(x['reward_mean'],2) for x in r][::3], 'mult_prob_err max', max(x['token_mult_prob_error'] for x in r), 'step s', round(r[-1]['time/step'],3))"
        cp "$OUT/tiny_te_$mode/metrics.jsonl" "$OUT/train_tiny_te_$mode.jsonl"; rm -rf "$OUT/tiny_te_$mode"
      done ;;
  esac
done
