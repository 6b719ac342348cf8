#!/usr/bin/env bash
# Llama-3.1-8B shapes (random weights) for 3 RL steps on one multi-GPU host, per "MODE:FSDP:TENSOR" argument:
#   bash benchmarks/scale_run.sh bf16:2:1 fp8_e2e:2:1 fp8_e2e:1:2
# Batch sizes are cut from the shipped config (16 prompts x 8 samples, 512 new tokens) so three steps and their
# compiles fit a 10-minute call; SHIPPED=1 keeps configs/llama8b.py's own (128 prompts x 8, 2,048 new tokens, 512
# decode slots; files scale_MODE_FxT_shipped.jsonl). No checkpoint is written. Metrics land in
# $OUT/scale_MODE_FxT[_shipped].jsonl; benchmarks/scale_summary.py turns them into results/scale.json.
# A dry run of the same commands on forced CPU devices (a small model through SCALE_SET):
#   SCALE_CPU_DEVICES=4 SHIPPED=1 SCALE_SET="--config.model.preset=tiny ..." bash benchmarks/scale_run.sh fp8_e2e:4:1
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda PYTHONPATH=/tmp/site:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
# JAX takes 75% of each GPU by default; the shipped sizes' bf16 rollout (a bf16 KV cache of 128 slots x 2,304
# positions, 36 GiB a GPU, beside the replicated rollout weights and the sharded train state) needs more
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}
PYTHON=${PYTHON:-python3}
if [ -n "${SCALE_CPU_DEVICES:-}" ]; then
  export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$SCALE_CPU_DEVICES"
  echo "cpu x $SCALE_CPU_DEVICES" > "$OUT/device.txt"
else
  if ! $PYTHON -c "import ml_collections, grain, math_verify" 2>/dev/null && [ -d .gpu/wheels ]; then
    $PYTHON -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
fi
for spec in "$@"; do
  IFS=: read -r mode fsdp tensor <<< "$spec"
  name="scale_${mode}_${fsdp}x${tensor}"
  cut=(--config.rollout.prompts_per_step=16 --config.rollout.samples_per_prompt=8 --config.rollout.max_new_tokens=512
       --config.rollout.decode_slots=128 --config.rl.minibatches=2 --config.rl.microbatch_sequences=16)
  # SHIPPED=1 on 4 H200s: start-up + 2 steps took 330 s (fp8_e2e) and 300 s (bf16); a step ~110-130 s
  if [ "${SHIPPED:-0}" = 1 ]; then cut=(); name="${name}_shipped"; fi
  # the best BF16 path: cuBLAS GEMMs (XLA's Triton GEMMs are slower at these shapes; bench e2e's bf16_cublas)
  flags=${XLA_FLAGS:-}
  [ "$mode" = bf16 ] && [ -z "${SCALE_CPU_DEVICES:-}" ] && flags="$flags --xla_gpu_enable_triton_gemm=false"
  # on the time limit: SIGABRT, and Python's fault handler prints where every thread was
  XLA_FLAGS="$flags" PYTHONFAULTHANDLER=1 timeout -s ABRT ${SCALE_TIMEOUT:-420} $PYTHON -m fp8rl_jax.main --config=configs/llama8b.py --config.model.source=preset \
    --config.model.preset=llama3_8b --config.model.tokenizer=.gpu/smollm2_tok --config.model.preset_vocab=preset \
    --config.precision.mode="$mode" --config.precision.backend=${BACKEND:-xla} \
    --config.mesh.fsdp="$fsdp" --config.mesh.tensor="$tensor" --config.workdir="$OUT/$name" --steps=${SCALE_STEPS:-3} \
    ${cut[@]+"${cut[@]}"} ${SCALE_SET:-} \
    --config.checkpoint.save_final=False --config.logging.progress=False --config.logging.tensorboard=False \
    --config.logging.plots=False > "$OUT/$name.log" 2>&1
  echo "$name exit $?"; grep -v "^W\|warn" "$OUT/$name.log" | tail -3
  cp "$OUT/$name/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null && rm -rf "${OUT:?}/$name"
  $PYTHON -c "import json,sys; [print({k: round(v, 2) for k, v in json.loads(l).items() if k.startswith(('time/', 'memory/')) or k == 'step'}) for l in open(sys.argv[1])]" "$OUT/$name.jsonl" 2>/dev/null
done
