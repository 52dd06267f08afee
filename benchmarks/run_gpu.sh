#!/usr/bin/env bash
# The GPU runs whose results sit in benchmarks/results/ (an H200 machine, vLLM 0.22 and TRL 1.16
# from the wheel kit in ../shared/gpu, PYTHONPATH=/tmp/site-packages:$PWD). One or more stages per
# call, each writing under OUT_DIR; a failing stage does not stop the next:
#   bash benchmarks/run_gpu.sh OUT_DIR tests tests-0.6b switch-old switch-4b step-0.6b-256 step-4b-256-minirl
# Run it from a snapshot of a commit, stamped so the results name it: `git archive HEAD | tar -x -C .snap &&
# git rev-parse --short HEAD > .snap/COMMIT`.
# STEP_ARGS="--compilation-config '{...}'" STEP_TAG=_decode: more launch flags for minirl's step, a file suffix;
# STEP_LENGTHS=lognormal: minirl's completions cut at log-normal lengths (step.py --lengths).
# switch-old measures the checkout in .old/ (an earlier commit's minirl/ and actors/: `git archive
# be0b014 minirl actors | tar -x -C .old`), switch-4b this one, in the same lease.
set -uo pipefail
out=$1; shift; mkdir -p "$out"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
log() { echo "[run_gpu $(date +%H:%M:%S)] $*"; }
triton='{"attention_backend": "TRITON_ATTN"}'   # vllm.LLM's argument for Triton's attention kernel
fa3='{"attention_backend": "FLASH_ATTN"}'         # and for FlashAttention (3 on Hopper)
for stage in "$@"; do
  log "stage $stage"
  case "$stage" in
    tests)   # the co-located loop with sleep/wake + sync, and varlen packing, on CUDA (tiny model)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu_env.txt"
      python -c 'import torch, vllm, ray; print(torch.__version__, vllm.__version__, ray.__version__)' >> "$out/gpu_env.txt"
      MINIRL_RESULTS_DIR=$out/tests timeout 300 python -m pytest tests/gpu -q 2>&1 | tail -15 | tee "$out/gpu_tests_tiny.log" ;;
    tests-trainer)   # the trainer's GPU tests alone (varlen packing, log-probs plain and compiled, their memory)
      MINIRL_RESULTS_DIR=$out/tests timeout 300 python -m pytest tests/gpu/test_trainer_gpu.py -q 2>&1 | tail -8 ;;
    varlen-gqa)   # packed attention with grouped K/V heads as they are vs repeated per query head (0.6B, 4B)
      timeout 200 python benchmarks/varlen_gqa.py --out "$out/varlen_gqa.json" 2>&1 | tail -4 ;;
    logprobs)   # token_logprobs plain and fused at 16,384 rows (0.6B's LM head) and 8,192 (4B's);
      # LOGPROBS_BASELINE=PATH: another core.py beside it (`git show REV:minirl/core.py > PATH`)
      base=(); [[ -n ${LOGPROBS_BASELINE:-} ]] && base=(--baseline "$LOGPROBS_BASELINE")
      timeout 200 python benchmarks/logprobs.py "${base[@]}" --out "$out/logprobs_h200.json" 2>&1 | tail -12
      timeout 200 python benchmarks/logprobs.py "${base[@]}" --rows 8192 --hidden 2560 --temperatures 1.0 \
        --out "$out/logprobs_h200_8k.json" 2>&1 | tail -9 ;;
    tests-0.6b|tests-4b|tests-smollm2)   # the same co-located tests at the Qwen3-0.6B / 4B shapes, or on SmolLM2-135M
      shape=${stage#tests-}; [[ $shape == smollm2 ]] || shape=qwen3-$shape
      MINIRL_GPU_SHAPE=$shape MINIRL_RESULTS_DIR=$out/tests_${stage#tests-} timeout 400 python -m pytest tests/gpu -q \
        -k "not varlen" 2>&1 | tail -15 | tee "$out/gpu_tests_${stage#tests-}.log" ;;
    switch-old)   # the verified switch of the earlier commit in .old/ (eager, resident, as it ran)
      timeout 400 python benchmarks/switch.py --shape qwen3-4b --eager --settings resident-verified \
        --minirl-from "$PWD/.old" --out "$out/switch_4b_old.json" 2>&1 | tail -4 ;;
    switch-4b-eager)   # this commit with switch-old's settings
      timeout 400 python benchmarks/switch.py --shape qwen3-4b --eager --settings resident-verified \
        --out "$out/switch_4b_eager.json" 2>&1 | tail -4 ;;
    switch-4b)   # this commit: switch-old's settings with and without the check, then its default engine
      timeout 400 python benchmarks/switch.py --shape qwen3-4b --eager --settings resident-verified,resident \
        --out "$out/switch_4b_eager.json" 2>&1 | tail -4
      timeout 400 python benchmarks/switch.py --shape qwen3-4b --settings resident-verified,sleep2-verified \
        --out "$out/switch_4b.json" 2>&1 | tail -4 ;;
    step-*)   # the whole GRPO step beside TRL: step-SHAPE-TOKENS[-minirl|-trl]
      IFS=- read -r _ shape tokens side <<< "$stage"
      # TRL's micro-batch holds the same tokens at every length (64 x 256 at 0.6B, 16 x 256 at 4B, where
      # it recomputes: without, it ran out of memory); one warm-up step (the second already ran as the
      # later ones on both sides, 2026-12-03), then 3 steps at 256 tokens and 2 at 1,024
      mb=$((64 * 256 / tokens)); ckpt=(); [[ $shape == 4b ]] && { mb=$((16 * 256 / tokens)); ckpt=(--trl-grad-ckpt); }
      steps=4; [[ $tokens -gt 256 ]] && steps=3
      timeout "${STEP_TIMEOUT:-580}" python benchmarks/step.py --shape "qwen3-$shape" --max-tokens "$tokens" --steps $steps --warmup 1 \
        --sides "${side:-minirl,trl}" --trl-micro-batch $mb "${ckpt[@]}" ${STEP_ARGS:+"--minirl-args=$STEP_ARGS"} \
        ${STEP_LENGTHS:+--lengths "$STEP_LENGTHS"} \
        --out "$out/step_qwen3-${shape}_${tokens}${side:+_$side}${STEP_LENGTHS:+_$STEP_LENGTHS}${STEP_TAG:-}.json" 2>&1 | grep -v "^\[" | tail -6 ;;
    profile-*)   # minirl's step (launch defaults) with its last step's phases under torch.profiler
      IFS=- read -r _ shape tokens <<< "$stage"
      timeout 600 python benchmarks/step.py --shape "qwen3-$shape" --max-tokens "$tokens" --steps 4 --warmup 1 \
        --sides minirl --profile "$out/profile_${shape}_${tokens}" \
        --out "$out/profile_qwen3-${shape}_${tokens}.json" 2>&1 | grep -v "^\[" | tail -4
      head -40 "$out/profile_${shape}_${tokens}"/*.txt ;;
    episodes)   # 256 concurrent 3-turn episodes with 0-500 ms tool waits vs single-turn, Qwen3-0.6B shape
      timeout 420 python benchmarks/episodes.py --out "$out/episodes_h200_qwen3-0.6b.json" 2>&1 | grep -v "^\[" | tail -8 ;;
    episodes-vllm)   # the same with vLLM's own compilation (torch.compile, FULL_AND_PIECEWISE graphs)
      timeout 420 python benchmarks/episodes.py --compilation-config '{}' \
        --out "$out/episodes_h200_qwen3-0.6b_vllm.json" 2>&1 | grep -v "^\[" | tail -8 ;;
    episodes-full)   # full CUDA graphs for steps that mix a new turn's prefill with decodes too (FA3 on Hopper
      # supports them), instead of piecewise graphs for those steps: what the episodes lose per step
      timeout 420 python benchmarks/episodes.py --compilation-config '{"cudagraph_mode": "FULL"}' \
        --out "$out/episodes_h200_qwen3-0.6b_full.json" 2>&1 | grep -v "^\[" | tail -8 ;;
    episodes-decode)   # decode-only CUDA graphs without torch.compile (the earlier default), same workload
      timeout 420 python benchmarks/episodes.py --compilation-config '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}' \
        --out "$out/episodes_h200_qwen3-0.6b_decode.json" 2>&1 | grep -v "^\[" | tail -8 ;;
    episodes-admit*)   # minirl's engine default, new turns admitted together every N steps: episodes-admitN
      timeout 420 python benchmarks/episodes.py --admit-wait-steps "${stage#episodes-admit}" \
        --out "$out/episodes_h200_qwen3-0.6b_${stage#episodes-}.json" 2>&1 | grep -v "^\[" | tail -8 ;;
    gsm8k)   # the GSM8K recipe at the Qwen3-0.6B shape: 1,024-token completions, evaluation included
      timeout 420 python benchmarks/gsm8k_recipe.py --steps "${GSM8K_STEPS:-4}" \
        --out "$out/gsm8k_recipe_h200_qwen3-0.6b.json" 2>&1 | grep -v "^\[" | tail -8 ;;
    modes)   # which modes fit co-located on one GPU, 0.6B-8B shapes
      python benchmarks/modes.py --budget "${MODES_BUDGET:-510}" --steps "${MODES_STEPS:-2}" ${MODES_MERGE:+--merge "$MODES_MERGE"} \
        --out "$out/modes_h200" 2>&1 | grep -v "^\[" | tail -40 ;;   # MODES_MERGE=an earlier modes.json
    lora-serving)   # LoRA served as merged weights vs as a vLLM adapter: tokens/s, sync, GRPO step, Qwen3-0.6B shape
      timeout 590 python benchmarks/lora_serving.py --out "$out/lora_serving_h200_qwen3-0.6b.json" 2>&1 | grep -v "^\[" | tail -8 ;;
    longtail-1gpu)   # co-located vs async sharing one H200 (0.6B shape, 128 x 8, median 500 tokens): the two
      # parts take ~5 min each, so one per call: LONGTAIL_PARTS=async LONGTAIL_MERGE=<the colocated JSON>
      m=${LONGTAIL_MERGE:-}; merge=(); [[ -n $m ]] && merge=(--merge "$m")
      timeout 560 python benchmarks/async_longtail.py --shape qwen3-0.6b --gpus 1 --steps 4 --warmup 1 \
        --parts "${LONGTAIL_PARTS:-colocated}" --timeout 330 "${merge[@]}" \
        --out "$out/longtail_h200_qwen3-0.6b_1gpu.json" 2>&1 | tail -25 ;;
    longtail-1gpu-ideal)   # gen and train alone (the ideal), merged with longtail-1gpu's JSON, then the cost model
      # (~4-5 min; its own call). LONGTAIL_MERGE=that JSON when it is not in this OUT_DIR (e.g. copied into the tree).
      m=${LONGTAIL_MERGE:-$out/longtail_h200_qwen3-0.6b_1gpu.json}; merge=(); [[ -f $m ]] && merge=(--merge "$m")
      timeout 560 python benchmarks/async_longtail.py --shape qwen3-0.6b --gpus 1 --steps 4 --warmup 1 \
        --parts gen_alone,train_alone --timeout 330 "${merge[@]}" \
        --out "$out/longtail_h200_qwen3-0.6b_1gpu_all.json" 2>&1 | tail -25
      python benchmarks/cost_model.py "$out/longtail_h200_qwen3-0.6b_1gpu_all.json" --gpus 8 64 \
        > "$out/longtail_h200_qwen3-0.6b_1gpu_cost.txt" 2>&1; tail -8 "$out/longtail_h200_qwen3-0.6b_1gpu_cost.txt" ;;
    decode-host)   # where a decode step's time goes: the launch's rollout vs raw generate, levers one at a
      # time, cProfile (host) and torch.profiler (device) of the rollout; DECODE_SHAPE (qwen3-0.6b)
      timeout 500 python benchmarks/decode_host.py --shape "${DECODE_SHAPE:-qwen3-0.6b}" \
        --out "$out/decode_host_${DECODE_SHAPE:-qwen3-0.6b}.json" 2>&1 | grep -v "^\[\|INFO\|WARNING" | tail -60 ;;
    decode-host-lever)   # one engine setting changed (DECODE_KWARGS, JSON; DECODE_TAG names the file): the
      # launch's rollout and raw generate without log-probs on that engine, with both profiles
      kwargs=${DECODE_KWARGS:-"{}"}
      timeout 300 python benchmarks/decode_host.py --shape "${DECODE_SHAPE:-qwen3-0.6b}" --short \
        --engine-kwargs "$kwargs" --out "$out/decode_host_${DECODE_SHAPE:-qwen3-0.6b}_${DECODE_TAG:-lever}.json" \
        2>&1 | grep -E "ms/step|^device:|Error" | tail -12 ;;
    decode-levers)   # the launch's engine, then each attention lever on its own engine (decode-host-lever each)
      levers=('base={}' 'splits1={"attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}}'
              "triton=$triton" 'base_2={}')
      for lever in "${levers[@]}"; do
        DECODE_TAG=${lever%%=*} DECODE_KWARGS=${lever#*=} bash "$0" "$out" decode-host-lever
      done ;;
    attn-exact)   # minirl's engine (Triton's attention kernel on Hopper) and with FlashAttention 3: log-probs
      # beside HF's fp32, before and after a load
      timeout 400 python benchmarks/engine_exact.py --models tiny,tiny-hd128,q06-2l --settings default,fa3 --extra "" \
        --out "$out/engine_exact_attn.json" 2>&1 | grep -v "^\[" | tail -12 ;;
    episodes-fa3)   # the episodes with FlashAttention 3 (steps that admit a new turn mix prefill and decode)
      timeout 420 python benchmarks/episodes.py --engine-kwargs "$fa3" \
        --out "$out/episodes_h200_qwen3-0.6b_fa3.json" 2>&1 | grep -v "^\[" | tail -8 ;;
    fa3-*)   # minirl's step with FlashAttention 3, then with the launch's engine: fa3-SHAPE-TOKENS
      IFS=- read -r _ shape tokens <<< "$stage"
      STEP_TAG=_fa3 STEP_ARGS="--engine-kwargs '$fa3'" \
        bash "$0" "$out" "step-$shape-$tokens-minirl"
      bash "$0" "$out" "step-$shape-$tokens-minirl" ;;
    decode-host-mp)   # the same with the engine core in its own process (vLLM's default), as minirl does not run it
      timeout 500 python benchmarks/decode_host.py --shape "${DECODE_SHAPE:-qwen3-0.6b}" --engine-process \
        --out "$out/decode_host_${DECODE_SHAPE:-qwen3-0.6b}_mp.json" 2>&1 | grep -v "^\[\|INFO\|WARNING" | tail -40 ;;
    soak)   # the async backend on one GPU (tiny model, two generators and the trainer sharing it) under
      # generator, queue, trainer and queue+trainer kills for SOAK_MINUTES (6); every prompt trained once?
      timeout 590 python benchmarks/soak.py --gpu --minutes "${SOAK_MINUTES:-6}" --max-gap 30 \
        --out "$out/soak_gpu.json" 2>&1 | tail -12 ;;
    *) log "unknown stage $stage" ;;
  esac
done
log done
