#!/usr/bin/env bash
# One GPU session on the lent H100 (or an H200 host): install Transformer Engine and the project's wheels once, then
# the stages named on the command line. Results land in $OUT (or ./gpu_out).
#   usage: bash benchmarks/gpu_session.sh [install] [tests] [demo_scaled] [decode] [llama1b:MODE] [rollout1k] [gemm] [train] [e2e] [e2e_xla] [profile] [cluster_nb] [study] [rollout_xla] [rollout_head] [rollout_flags]
#          [cublaslt] [normtiles] [async] [rollout8b] [agreement] [exact] [packed_attention] [e2e8b] [profile8b] [head_step] [headgrad] [multiprocess] [transpose] [swiglu] [fp8gemm] [bgemm] [bquant] [blinear]...
# TE arrives in pieces (see ../shared/gpu/README.md): .gpu/te/wheels + .gpu/install_te.sh, the core wheel's five
# parts already copied to /root/te by earlier calls; the other wheels in .gpu/wheels; a tokenizer in .gpu/smollm2_tok.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda PYTHONPATH=/tmp/site:$PWD
# installs survive on a warm machine: skip what is there
if ! python3 -c "import transformer_engine.jax" 2>/dev/null && [ -d .gpu/te/wheels ]; then
  bash .gpu/install_te.sh .gpu/te/wheels > "$OUT/te_install.log" 2>&1 || tail -20 "$OUT/te_install.log"
fi
if ! python3 -c "import ml_collections, grain, math_verify" 2>/dev/null && [ -d .gpu/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
fi
if ! python3 -c "import nbclient, ipykernel" 2>/dev/null && [ -d .gpu/nbwheels ]; then  # the notebook extra
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/nbwheels/*.whl
fi
# the SmolLM2 GGUF, carried in pieces into /root/gguf by earlier calls, into the project's model cache
export FP8RL_CACHE=${FP8RL_CACHE:-/root/fp8rl_cache}
gguf="$FP8RL_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ] && ls /root/gguf/gguf_part_* >/dev/null 2>&1; then
  mkdir -p "$FP8RL_CACHE/smollm2" && cat /root/gguf/gguf_part_* > "$gguf.partial" && mv "$gguf.partial" "$gguf"
fi  # its tokenizer is converted from the GGUF on first use (gguf + tokenizers; no transformers needed)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
dev=$(grep -oi 'h[0-9]00' "$OUT/device.txt" | head -1 | tr 'H' 'h'); dev=${dev:-gpu}  # results are named by the GPU
# e2e8b's and profile8b's model: the Llama-3.1-8B width, E8B_LAYERS layers, microbatches of 16
width8b=(--set model.source=preset --set model.preset=llama3_8b --set model.num_layers=${E8B_LAYERS:-10}
         --set model.tokenizer=.gpu/smollm2_tok --set model.preset_vocab=preset --set rl.microbatch_sequences=16)
for what in "$@"; do
  case $what in
    install) ;;
    tests) timeout 400 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    decode) timeout 500 python3 benchmarks/decode_attention.py --models 1b --out "$OUT/decode_attention_${dev}.json" \
        2>&1 | grep -vi warn | tee "$OUT/decode_attention.log" | tail -30 ;;
    llama1b:*) mode=${what#llama1b:}
      # random Llama-3.2-1B weights with the real shapes (vocab 128256: ids past the tokenizer decode to ""),
      # the shipped batch sizes, GSM8K prompts through the SmolLM2 tokenizer, 3 RL steps
      timeout 560 python3 -m fp8rl_jax.main --config=configs/llama1b.py --config.model.source=preset \
        --config.model.preset=llama3_1b --config.model.tokenizer=.gpu/smollm2_tok --config.model.preset_vocab=preset \
        --config.precision.mode="$mode" --config.workdir="$OUT/llama1b_$mode" --steps=3 \
        --config.logging.progress=False --config.logging.tensorboard=False --config.logging.plots=False \
        ${LLAMA1B_ARGS:-} > "$OUT/llama1b_$mode.log" 2>&1
      echo "llama1b $mode exit $?"; grep -v "^W\|Warn" "$OUT/llama1b_$mode.log" | tail -4
      cp "$OUT/llama1b_$mode/metrics.jsonl" "$OUT/llama1b_$mode.jsonl" 2>/dev/null
      python3 - "$OUT/llama1b_$mode.jsonl" <<'EOF'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    print({k: round(v, 2) for k, v in r.items() if k.startswith(("time/", "memory/")) or k in ("step", "rollout_tokens_per_s")})
EOF
      rm -rf "$OUT/llama1b_$mode" ;;
    fp8gemm) # the decode step's FP8 GEMMs alone: kernels.fp8_gemm (swept) against TE's and XLA's cuBLASLt
      timeout ${FG_TIMEOUT:-480} python3 benchmarks/fp8_gemm.py ${FG_ARGS:---sweep} --out "$OUT/fp8_gemm_${dev}.json" 2>&1 \
        | grep -vi warn > "$OUT/fp8_gemm.log"; tail -12 "$OUT/fp8_gemm.log" ;;
    bgemm) # the Mosaic GPU block-scaled FP8 GEMM (kernels/block_gemm.py): its tests on this GPU, then its speed against
      # block.block_gemm's XLA emulation, a per-tensor FP8 dot and BF16 (cuBLAS); BGEMM_ARGS (e.g. --sweep), BGEMM_TAG
      timeout ${BGEMM_TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_block_gemm.py \
        tests/kernels/test_block_quantize.py 2>&1 \
        | tee "$OUT/bgemm_tests${BGEMM_TAG:-}.log" | tail -25
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" timeout ${BGEMM_TIMEOUT:-400} python3 \
        benchmarks/block_gemm_speed.py ${BGEMM_ARGS:-} --out "$OUT/block_gemm${BGEMM_TAG:-}_${dev}.json" 2>&1 \
        | grep -v "^W\|Warn" | tee "$OUT/block_gemm${BGEMM_TAG:-}.log" | grep "^{\|rror\|wrote" | cut -c1-400 ;;
    cublaslt) # cuBLASLt's block-scaled FP8 GEMM (kernels/cublaslt): its library (.gpu/cublaslt, built where cuBLAS's
      # headers are: the image has no compiler headers for it) into the model cache, where the e2e children find it;
      # its GPU tests; its kernel time against the Mosaic kernel (default tuning), per-tensor FP8 and BF16 at llama1b's
      # training shapes (fprop/dgrad BF16 out; the wgrad's form f32 out) and decode shapes (256 slots, unless
      # CL_DECODE=0); CL_ALGOS: each of the heuristic's first N algorithms
      lib=.gpu/cublaslt/$(python3 -c "from fp8rl_jax.kernels import cublaslt; print(cublaslt.library_name())")
      [ -f "$lib" ] && mkdir -p "$FP8RL_CACHE/kernels" && cp "$lib" "$FP8RL_CACHE/kernels/"
      timeout ${CL_TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_cublaslt.py 2>&1 \
        | tee "$OUT/cublaslt_tests.log" | tail -15
      bg=(python3 benchmarks/block_gemm_speed.py --commit "${FP8RL_COMMIT:-}" --distinct-weights --trace --default-tuning
          --repeats 4 --cublaslt-algos ${CL_ALGOS:-1})
      timeout 240 "${bg[@]}" --shapes 40960x3072x2048,40960x16384x2048,40960x2048x8192 --out-dtype bfloat16 \
        --paths cublaslt,mosaic,fp8_tensor,bf16 --out "$OUT/block_gemm_cublaslt_train_${dev}.json" 2>&1 \
        | grep "^{\|rror\|wrote" | cut -c1-330
      timeout 150 "${bg[@]}" --shapes 2048x16384x40960,8192x2048x40960 --paths cublaslt_rows,mosaic_rows,fp8_tensor \
        --out "$OUT/block_gemm_cublaslt_wgrad_${dev}.json" 2>&1 | grep "^{\|rror\|wrote" | cut -c1-330
      [ "${CL_DECODE:-1}" = 0 ] || timeout 150 "${bg[@]}" --shapes decode_qkv,decode_o,decode_gate_up,decode_down --out-dtype bfloat16 \
        --paths cublaslt,mosaic,fp8_tensor,bf16 --out "$OUT/block_gemm_cublaslt_decode_${dev}.json" 2>&1 \
        | grep "^{\|rror\|wrote" | cut -c1-330 ;;
    bquant) # the block quantizer kernel alone at the llama1b train step's sizes, by form and num_warps, with its
      # kernel time from a profiler trace (benchmarks/block_quantize_speed.py; BQ_ARGS)
      timeout ${BQ_TIMEOUT:-300} python3 benchmarks/block_quantize_speed.py --trace ${BQ_ARGS:-} \
        --out "$OUT/block_quantize_${dev}.json" 2>&1 | grep -v "^W\|Warn" | tee "$OUT/block_quantize.log" \
        | grep "^{\|rror\|wrote" | cut -c1-300 ;;
    blinear) # one linear's forward + backward at llama1b's training shapes: BF16, per-tensor and block-scaled FP8, the
      # block path's GEMMs and its quantizers apart (benchmarks/block_linear_speed.py; BL_ARGS)
      timeout ${BL_TIMEOUT:-240} python3 benchmarks/block_linear_speed.py ${BL_ARGS:-} --out "$OUT/block_linear_${dev}.json" \
        2>&1 | grep "^{\|rror\|wrote" | cut -c1-300 ;;
    head_step) # the LM head's forward + backward alone (HEAD_VARIANTS, default BF16 / FP8 custom VJP / autodiff
      # FP8), llama1b and 8B widths; HEAD_TAG names the files
      timeout 200 python3 benchmarks/head_step.py --runs ${HEAD_RUNS:-3} --variants ${HEAD_VARIANTS:-bf16,fp8,fp8_autodiff} \
        --out "$OUT/head_step${HEAD_TAG:-}_${dev}.json" 2>&1 | grep "^{" | cut -c1-160
      timeout 120 python3 benchmarks/head_step.py --runs ${HEAD_RUNS:-3} --hidden 4096 --untied \
        --variants ${HEAD_VARIANTS:-bf16,fp8} --out "$OUT/head_step${HEAD_TAG:-}_8b_${dev}.json" 2>&1 | grep "^{" | cut -c1-160 ;;
    headgrad) # the head's fused FP8 logit gradient kernel against its XLA form (one llama1b head chunk; HG_ARGS)
      timeout ${HG_TIMEOUT:-240} python3 benchmarks/head_grad.py ${HG_ARGS:-} --out "$OUT/head_grad${HG_TAG:-}_${dev}.json" \
        2>&1 | grep "^{\|rror" | cut -c1-400 ;;
    packed_attention) # cuDNN packed attention's memory and time against its segment table's size (llama1b heads)
      timeout 300 python3 benchmarks/packed_attention_memory.py ${PA_ARGS:-} --out "$OUT/packed_attention_${dev}.json" \
        2>&1 | grep -v "^W\|Warn" | tail -12 ;;
    rollout1k) # R1K_ARGS: e.g. "--batches 64 --profile"
      timeout ${R1K_TIMEOUT:-500} python3 -m fp8rl_jax.bench rollout --new_tokens 1024 --modes ${R1K_MODES:-bf16,fp8_kv_te} \
        ${R1K_ARGS:-} --out "$OUT/rollout_1k${R1K_TAG:-}.json" 2>&1 | grep -vi warn | tee "$OUT/rollout_1k${R1K_TAG:-}.log" \
        | grep "^{\|Error" | cut -c1-400 ;;
    e2e) # bench e2e on llama1b shapes (random weights), 32 prompts x 8 = 256 sequences: one decode wave of the
      # shipped 256 slots (the shipped 64 prompts take two waves and twice the device time per step)
      timeout 500 python3 -m fp8rl_jax.bench e2e --config configs/llama1b.py --set model.source=preset \
        --set model.preset=llama3_1b --set model.tokenizer=.gpu/smollm2_tok --set model.preset_vocab=preset \
        --set rollout.prompts_per_step=${E2E_PROMPTS:-32} ${E2E_SET:-} --modes ${E2E_MODES:-fp8_e2e,bf16,fp8_rollout,bf16_cublas} \
        --steps ${E2E_STEPS:-1} --timeout ${E2E_MODE_TIMEOUT:-125} --out "$OUT/e2e_${dev}${E2E_TAG:-}.json" 2>&1 | grep -v "^W\|Warn" | tee "$OUT/e2e${E2E_TAG:-}.log" | tail -8 ;;
    e2e8b) # bench e2e at the Llama-3.1-8B width with E8B_LAYERS layers (default 10; the whole preset does not train on
      # one GPU), the llama1b config's batch shapes in microbatches of 16: issue 23's e2e_8b_width_h100.json. At JAX's
      # default 75% of the H100, microbatches of 32 ran out of memory (at 8094864); 10 layers peak at 68.7 GiB of 94%
      XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94} timeout 560 python3 -m fp8rl_jax.bench e2e \
        --config configs/llama1b.py "${width8b[@]}" --set rollout.prompts_per_step=${E2E_PROMPTS:-32} ${E2E_SET:-} \
        --modes ${E2E_MODES:-fp8_e2e,bf16_cublas} --steps ${E2E_STEPS:-1} --timeout ${E2E_MODE_TIMEOUT:-250} \
        --out "$OUT/e2e_8b_width_${dev}.json" 2>&1 | grep -v "^W\|Warn" | tee "$OUT/e2e8b.log" | tail -8 ;;
    e2e_xla) # bench e2e in processes without Transformer Engine (FP8 on the xla backend): there `precision.attention`
      # auto is cuDNN flash attention (TE's cuDNN beside JAX's breaks its backward); E2E_SET adds --set overrides, E2E_STEPS
      # timed steps a mode (default 1)
      [ -d /tmp/site_note ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site_note .gpu/wheels/*.whl
      PYTHONPATH=/tmp/site_note:$PWD timeout 560 python3 -m fp8rl_jax.bench e2e --config configs/llama1b.py \
        --set model.source=preset --set model.preset=llama3_1b --set model.tokenizer=.gpu/smollm2_tok \
        --set model.preset_vocab=preset --set rollout.prompts_per_step=${E2E_PROMPTS:-32} ${E2E_SET:-} \
        --modes ${E2E_MODES:-fp8_e2e,bf16_cublas} --steps ${E2E_STEPS:-1} --timeout ${E2E_MODE_TIMEOUT:-170} \
        --out "$OUT/e2e_xla_${dev}${E2E_TAG:-}.json" 2>&1 | grep -v "^W\|Warn" | tee "$OUT/e2e_xla${E2E_TAG:-}.log" | tail -8 ;;
    profile) # top GPU kernels of a decode chunk (PROFILE_DECODE_CHUNKS consecutive ones) and a train step (llama1b
      # shapes, one wave of 256 sequences);
      # PROFILE_DUMP=1 also keeps the optimized HLO of those two programs (the fusions the kernel names refer to);
      # PROFILE_ARGS=--graphs keeps XLA's CUDA graphs under the profiler (XLA launches their kernels one by one there)
      dump=(); [ -n "${PROFILE_DUMP:-}" ] && dump=(env "XLA_FLAGS=${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo_dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step|jit__generate_steps_impl")
      "${dump[@]}" timeout 400 python3 benchmarks/profile_step.py --config configs/llama1b.py --set model.source=preset \
        --set model.preset=llama3_1b --set model.tokenizer=.gpu/smollm2_tok --set model.preset_vocab=preset \
        --set rollout.prompts_per_step=32 --modes ${PROFILE_MODES:-bf16_cublas,fp8_e2e} --timeout 190 \
        --top ${PROFILE_TOP:-25} --decode_chunks ${PROFILE_DECODE_CHUNKS:-1} ${PROFILE_ARGS:-} --out "$OUT/profile_${dev}.json" 2>&1 | grep -v "^W\|Warn" | tee "$OUT/profile.log" | tail -6
      [ -d /tmp/hlo_dump ] && (cd /tmp/hlo_dump && tar czf "$OUT/hlo_dump.tgz" $(ls | grep after_optimizations.txt)) ;;
    profile8b) # the same at the Llama-3.1-8B width with E8B_LAYERS layers (e2e8b's shapes and memory settings)
      XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94} timeout 500 python3 benchmarks/profile_step.py \
        --config configs/llama1b.py "${width8b[@]}" --set rollout.prompts_per_step=32 \
        --modes ${PROFILE_MODES:-bf16_cublas,fp8_e2e_head} --timeout 230 --top ${PROFILE_TOP:-25} \
        --decode_chunks ${PROFILE_DECODE_CHUNKS:-1} --out "$OUT/profile_8b_width_${dev}.json" 2>&1 | grep -v "^W\|Warn" | tee "$OUT/profile8b.log" | tail -6 ;;
    cluster_nb) # the cluster notebook on this host's GPUs (smollm2_gsm8k, FSDP over all of them), outputs kept
      FP8RL_NOTEBOOK_WORKDIR=/tmp/cluster_nb timeout ${NB_TIMEOUT:-300} python3 benchmarks/run_notebook.py \
        notebooks/cluster.ipynb "$OUT/cluster_executed.ipynb" 2>&1 | grep -v "^W\|Warn" | tail -5 ;;
    async) # bench async: synchronous on all GPUs against the rollout on ASYNC_SPLITS GPUs, llama1b shapes (random
      # weights), lognormal lengths of mean 0.3 x max_new_tokens
      timeout ${ASYNC_TIMEOUT:-560} python3 -m fp8rl_jax.bench async --config configs/llama1b.py --set model.source=preset \
        --set model.tokenizer=.gpu/smollm2_tok --set model.preset_vocab=preset --splits ${ASYNC_SPLITS:-0,1} \
        --lengths ${ASYNC_LENGTHS:-lognormal:0.3,1.0} --warmup ${ASYNC_WARMUP:-2} --steps ${ASYNC_STEPS:-8} \
        --timeout ${ASYNC_VARIANT_TIMEOUT:-270} ${ASYNC_ARGS:-} --out "$OUT/async_gpu.json" 2>&1 | grep -v "^W\|Warn" \
        | tee "$OUT/async.log" | tail -8 ;;
    study) # the fidelity study (configs/smollm2_arith.py): STUDY_SEEDS split in order over the host's GPUs (or the
      # first STUDY_GPUS), a study process a GPU with STUDY_ARGS' --parallel runs at once on each; merged into
      # $OUT/$name.json, every mode paired with BF16 by seed where both ran (benchmarks/accuracy_merge.py); the runs
      # in one file, $OUT/${name}_runs.tgz
      name=${STUDY_NAME:-study}
      IFS=, read -ra seeds <<< "${STUDY_SEEDS:-0}"
      gpus=${STUDY_GPUS:-$(nvidia-smi -L | wc -l)}; [ "$gpus" -gt "${#seeds[@]}" ] && gpus=${#seeds[@]}
      for ((g = 0; g < gpus; g++)); do
        part=$(IFS=,; echo "${seeds[*]:$((g * ${#seeds[@]} / gpus)):$(((g + 1) * ${#seeds[@]} / gpus - g * ${#seeds[@]} / gpus))}")
        CUDA_VISIBLE_DEVICES=$g timeout 590 python3 benchmarks/accuracy_study.py --seeds "$part" \
          --timeout ${STUDY_TIMEOUT:-480} --workdir /tmp/$name --out /tmp/${name}_gpu$g.json --docs /tmp/${name}_docs$g \
          ${STUDY_ARGS:-} > /tmp/${name}_gpu$g.log 2>&1 &
      done
      wait
      for ((g = 0; g < gpus; g++)); do grep -v "^W\|Warn\|legend" /tmp/${name}_gpu$g.log | grep "^| \|left out\|failed"; done
      python3 benchmarks/accuracy_merge.py --into "$OUT/$name.json" /tmp/${name}_gpu*.json | tail -12
      # the runs' records and logs in one file (the device tool brings back only a few files a call), not their
      # checkpoints: with --eval_bf16 each run keeps its final one, and an archive with those ran into a call's
      # limit and was too big to come back
      (cd /tmp/$name && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' \) -print0 \
        | tar czf "$OUT/${name}_runs.tgz" --null -T -) ;;
    rollout_flags) # bench rollout (R1K_MODES, R1K_ARGS) once per set of XLA flags in R1K_FLAG_SETS (';'-separated; an
      # empty set is the defaults), each set on top of --xla_gpu_enable_triton_gemm=false, each in its own process;
      # R1K_DUMP=1 also keeps each set's optimized decode program (gzipped HLO) under $OUT/hlo_flags<i>
      i=0; IFS=';' read -ra sets <<< "${R1K_FLAG_SETS:-}"
      for set in "${sets[@]}"; do
        dump=""; [ -n "${R1K_DUMP:-}" ] && dump="--xla_dump_to=/tmp/dump_flags$i --xla_dump_hlo_as_text"
        echo "flag set $i: ${set:-(defaults)}"
        XLA_FLAGS="--xla_gpu_enable_triton_gemm=false $set $dump" timeout ${R1K_TIMEOUT:-300} python3 -m fp8rl_jax.bench \
          rollout --new_tokens 1024 --modes ${R1K_MODES:-bf16,fp8_kv_te} ${R1K_ARGS:-} \
          --out "$OUT/rollout_flags$i.json" 2>&1 | grep -vi warn > "$OUT/rollout_flags$i.log"
        python3 - "$OUT/rollout_flags$i.json" "$set" <<'EOF2'
import json, sys
rows = json.load(open(sys.argv[1]))
for r in rows:
    r["xla_flags"] = sys.argv[2]
    print(r["batch"], r["mode"], r["variant"], r["tokens_per_s"], r["ms_per_step"], r.get("profile", {}).get("kernels_per_step"))
json.dump(rows, open(sys.argv[1], "w"), indent=1)
EOF2
        if [ -n "${R1K_DUMP:-}" ]; then mkdir -p "$OUT/hlo_flags$i"
          for f in $(grep -l "decode_attention" /tmp/dump_flags$i/*after_optimizations.txt | head -4); do
            gzip -c "$f" > "$OUT/hlo_flags$i/$(basename "$f").gz"; done; fi
        i=$((i + 1))
      done ;;
    rollout_xla) # the decode GEMMs through XLA's FP8 dot against TE's, with the decode kernel, batch 256, 1k tokens
      timeout 400 python3 -m fp8rl_jax.bench rollout --new_tokens 1024 --batches 256 --modes bf16,fp8_kv,fp8_kv_te \
        --out "$OUT/rollout_xla_vs_te.json" 2>&1 | grep -vi warn | tee "$OUT/rollout_xla.log" | tail -8 ;;
    rollout_head) # the LM head in FP8 too: decode speed at batch 64 and 256 (cuBLAS for the BF16 GEMMs)
      XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 500 python3 -m fp8rl_jax.bench rollout --new_tokens 1024 \
        --batches 64,256 --modes bf16,fp8_kv_te,fp8_kv_te_head --out "$OUT/rollout_head_${dev}.json" 2>&1 \
        | grep -vi warn | tee "$OUT/rollout_head.log" | grep "^{" ;;
    rollout8b) # the Llama-3.1-8B shape on one GPU (an H200: bf16 8B does not fit an H100 with 256 sequences)
      XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout ${R8B_TIMEOUT:-560} python3 -m fp8rl_jax.bench rollout --model llama3_8b \
        --new_tokens 1024 --batches ${R8B_BATCHES:-64,256} --modes ${R8B_MODES:-bf16,fp8_kv_te} ${R8B_ARGS:-} \
        --out "$OUT/rollout_8b${R8B_TAG:-}.json" 2>&1 | grep -vi warn | tee "$OUT/rollout_8b${R8B_TAG:-}.log" | grep "^{\|Error" | cut -c1-400 ;;
    exact) # the exact sampler's tests on the GPU: BF16, XLA FP8 and the FP8 head as on CPU, and TE's GEMMs
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_exact.py 2>&1 | tee "$OUT/exact_tests.log" | tail -25 ;;
    agreement) # rollout vs scoring logprobs per precision variant (SmolLM2, 6 GSM8K solutions, teacher-forced)
      timeout 400 python3 -m fp8rl_jax.bench agreement --precisions ${AGREE_PRECISIONS:-bf16,fp8,fp8_head,fp8_te} \
        --out "$OUT/agreement.json" 2>&1 | grep -v "^W\|Warn" | tee "$OUT/agreement.log" | grep "^{\|Error" | cut -c1-300 ;;
    transpose) # the FP8 wgrad's transposes: XLA's against the Pallas kernel's block shapes (llama1b microbatch shapes)
      timeout 300 python3 benchmarks/transpose_fp8.py --out "$OUT/transpose_fp8_${dev}.json" 2>&1 | grep "^{\|rror" \
        | cut -c1-1500 ;;
    normtiles) # the rollout's forward tiles from its norm and decode attention kernels (block scaling): their GPU
      # tests, the norm kernel alone, then bench rollout (a decode wave of 256, profiled) of this tree and, where
      # .gpu/old holds an older tree (git archive of fp8rl_jax configs benchmarks), of that one, block scaling alone
      timeout ${NT_TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu ${NT_TESTS:-tests/model/test_norm.py \
        tests/kernels/test_decode_attention.py tests/kernels/test_block_quantize.py tests/fp8/test_te_gpu.py} 2>&1 \
        | tee "$OUT/normtiles_tests.log" | tail -6
      timeout 200 python3 benchmarks/norm_tiles_speed.py --trace --commit "${FP8RL_COMMIT:-}" ${NT_ARGS:-} \
        --out "$OUT/norm_tiles_${dev}.json" 2>&1 | grep "^{\|rror\|wrote" | cut -c1-300
      roll=(python3 -m fp8rl_jax.bench rollout --batches 256 --new_tokens 512 --prompt_len 64 --chunk 8 --profile)
      XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 300 "${roll[@]}" --modes ${NT_MODES:-fp8_kv_block,fp8_kv} \
        --out "$OUT/rollout_normtiles_${dev}.json" 2>&1 | grep "^{\|rror" | cut -c1-300
      if [ -d .gpu/old/fp8rl_jax ]; then
        (cd .gpu/old && PYTHONPATH=/tmp/site:$PWD XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 200 "${roll[@]}" \
          --modes fp8_kv_block --out "$OUT/rollout_normtiles_old_${dev}.json" 2>&1 | grep "^{\|rror" | cut -c1-300)
      fi ;;
    swiglu) # the MLP's fused SwiGLU backward kernel against the XLA ops it replaces (llama1b microbatch shapes unless
      # SWIGLU_ARGS says otherwise, e.g. "--tokens 20480 --intermediate 14336 --configs 32x64:4"); SWIGLU_NAME
      timeout ${SWIGLU_TIMEOUT:-300} python3 benchmarks/swiglu_grad.py ${SWIGLU_ARGS:-} \
        --out "$OUT/${SWIGLU_NAME:-swiglu_grad_${dev}}.json" 2>&1 | grep "^{\|rror" | cut -c1-400 ;;
    gemm) timeout 420 python3 -m fp8rl_jax.bench gemm --out "$OUT/gemm_${dev}.json" 2>&1 | grep -vi warn | tee "$OUT/gemm.log" | tail -3 ;;
    train) for mode in fp8_e2e bf16; do
        timeout 240 python3 -m fp8rl_jax.main --config=configs/tiny.py:$mode --config.precision.backend=te \
          --config.workdir="$OUT/tiny_te_$mode" --config.logging.progress=False --config.logging.tensorboard=False \
          --config.logging.plots=False > "$OUT/train_$mode.log" 2>&1; tail -3 "$OUT/train_$mode.log"
        cp "$OUT/tiny_te_$mode/metrics.jsonl" "$OUT/train_tiny_te_$mode.jsonl"; rm -rf "$OUT/tiny_te_$mode"
      done ;;
    demo_scaled) # issue 41's acceptance: the demo scaled as a new GPU user would (32 prompts x 8 samples x 256 new
      # tokens, nothing else), 20 steps; FP8RL_COMMIT names the tree that runs
      timeout 560 python3 benchmarks/demo_scaled.py --out "$OUT/demo_scaled_${dev}.json" ${DEMO_LOG:+--log "$OUT/demo_scaled.log"} \
        2>&1 | grep -v "^W\|Warn" | tail -16 ;;
    scaled_demo) # issue 21: the demo scaled up (256 sequences x 256 new tokens) with no microbatch override, 3 steps;
      # then an intentionally oversized microbatch (the whole minibatch) that must end in one out-of-memory line
      args="--config=configs/smollm2_gsm8k.py --config.rollout.prompts_per_step=32 --config.rollout.samples_per_prompt=8
        --config.rollout.max_new_tokens=256 --config.rollout.decode_slots=256 --config.logging.progress=False
        --config.logging.tensorboard=False --config.logging.plots=False --config.checkpoint.save_final=False"
      timeout ${DEMO_TIMEOUT:-400} python3 -m fp8rl_jax.main $args --config.workdir=/tmp/scaled --steps=3 \
        > "$OUT/scaled_demo.log" 2>&1; echo "scaled demo exit $?"; grep -v "^W\|Warn" "$OUT/scaled_demo.log" | tail -4
      cp /tmp/scaled/metrics.jsonl "$OUT/scaled_demo.jsonl" 2>/dev/null
      python3 - "$OUT/scaled_demo.jsonl" <<'EOF2'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    print({k: round(v, 2) for k, v in r.items() if k.startswith(("time/", "memory/")) or k in ("step", "reward")})
EOF2
      timeout 200 python3 -m fp8rl_jax.main $args --config.workdir=/tmp/oom --steps=1 --config.rl.microbatch_tokens=0 \
        > "$OUT/oom.log" 2>&1; echo "oversized exit $?"; tail -c 1500 "$OUT/oom.log" ;;
    multiprocess) # launch/local.py on GPUs: 2 processes x 2 GPUs of this host, one mesh over the 4 (NCCL between
      # the processes), 2 RL steps of configs/tiny.py with a checkpoint each step, then a resume to step 3
      wd="$OUT/multiprocess_run"; rm -rf "$wd"
      mp=(python3 launch/local.py --platform=gpu --num_processes=2 --devices_per_process=2 --timeout=250 --
          --config=configs/tiny.py --config.mesh.fsdp=-1 --config.checkpoint.every=1 --config.workdir="$wd"
          --config.logging.plots=False --config.logging.progress=False ${MP_SET:-})
      "${mp[@]}" --steps=2 > "$OUT/multiprocess.log" 2>&1; echo "2 processes x 2 GPUs, 2 steps: exit $?"
      "${mp[@]}" --steps=3 >> "$OUT/multiprocess.log" 2>&1; echo "resume to step 3: exit $?"
      grep -a "resumed\|precision\|rror" "$OUT/multiprocess.log" | grep -v "^W" | head -20
      cp "$wd/metrics.jsonl" "$OUT/multiprocess_metrics.jsonl" 2>/dev/null; ls "$wd/checkpoints" 2>/dev/null ;;
    *) echo "unknown stage $what" ;;
  esac
done
