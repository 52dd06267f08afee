#!/usr/bin/env bash
# The GPU runs whose results sit in benchmarks/results/ (one H200 machine with 2 GPUs, vLLM 0.22
# from the wheel kit in ../shared/gpu, PYTHONPATH=/tmp/site:$PWD). One stage per call:
#   bash benchmarks/run_gpu.sh tests|switch|switch-4b|switch-0.6b|gen-4b|gen-4b-resident|gen-4b-graphs|gen-0.6b|async1|async2a|async2b|broadcast  OUT_DIR
set -uo pipefail
stage=$1; out=${2:-benchmarks/results}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled VLLM_ENABLE_V1_MULTIPROCESSING=0
case "$stage" in
  tests)    # co-located loop with sleep/wake + sync on CUDA (tiny, then the Qwen3-0.6B shape)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu_env.txt"
    python -c 'import torch, vllm, ray; print(torch.__version__, vllm.__version__, ray.__version__)' >> "$out/gpu_env.txt"
    CUDA_VISIBLE_DEVICES=0 MINIRL_RESULTS_DIR=$out timeout 300 python -m pytest tests/gpu -q -x 2>&1 | tail -20 | tee "$out/gpu_tests_tiny.log"
    CUDA_VISIBLE_DEVICES=0 MINIRL_GPU_SHAPE=qwen3-0.6b MINIRL_RESULTS_DIR=$out/q06 timeout 240 python -m pytest tests/gpu -q -x 2>&1 | tail -20 | tee "$out/gpu_tests_q06.log" ;;
  switch)   # both shapes; minirl at sleep level 2 and resident (0), verify on/off; raw vLLM beside;
            # then generation with raw, raw-with-minirl's-engine-settings and minirl engines alive
            # side by side, calls alternating (ABBA), 6 cycles (~6-7 min per shape: one per call)
    CUDA_VISIBLE_DEVICES=0 python launch/bench_switch.py --shapes qwen3-0.6b,qwen3-4b --reps 5 --out "$out/switch_h200.json" ;;
  switch-4b)   # switch, then generation beside raw vLLM with the same settings (three 4B engines
               # and a 4B trainer do not fit at 0.2 each)
    CUDA_VISIBLE_DEVICES=0 python launch/bench_switch.py --shapes qwen3-4b --reps 5 --timeout 240 --raw-settings minirl --out "$out/switch_h200_qwen3-4b.json" ;;
  switch-0.6b)
    CUDA_VISIBLE_DEVICES=0 python launch/bench_switch.py --shapes qwen3-0.6b --reps 5 --timeout 240 --out "$out/switch_h200_qwen3-0.6b.json" ;;
  gen-4b|gen-4b-resident|gen-4b-graphs|gen-0.6b)   # generation only, 8 ABBA cycles (~4 min eager);
               # resident: minirl's engine without sleep mode, and so the raw ones; graphs: CUDA
               # graphs for decode, no torch.compile (less bound by the host CPU than eager)
    shape=qwen3-${stage#gen-}; shape=${shape%-resident}; shape=${shape%-graphs}; level=2
    [[ $stage == *resident ]] && level=0
    extra=(); [[ $shape == qwen3-4b ]] && extra=(--raw-settings minirl)
    [[ $stage == *graphs ]] && extra+=(--no-eager --llm-kwargs '{"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}')
    CUDA_VISIBLE_DEVICES=0 python launch/bench_switch.py --shapes $shape --no-switch --gen-cycles 8 --gen-sleep-level $level --timeout 300 "${extra[@]}" --out "$out/${stage/gen-/gen_h200_qwen3-}.json" ;;
  async1)   # generation + training on fractional bundles of ONE GPU, object-store transport
    CUDA_VISIBLE_DEVICES=0 python launch/bench_async.py --shape qwen3-0.6b --gpus 1 --fraction 0.5 --parts async/object_store --steps 4 --max-tokens 64 --out "$out/async_h200_1gpu.json" ;;
  async2a)  python launch/bench_async.py --shape qwen3-0.6b --gpus 2 --parts allreduce,async/collective --steps 4 --max-tokens 64 --out "$out/async_h200_2gpu_a.json" ;;
  async2b)  python launch/bench_async.py --shape qwen3-0.6b --gpus 2 --parts async/object_store,colocated --steps 4 --max-tokens 64 --out "$out/async_h200_2gpu_b.json" ;;
  broadcast) python launch/bench_async.py --shape qwen3-0.6b --gpus 2 --parts allreduce,broadcast --allreduce-mb 1024 --out "$out/broadcast_h200_2gpu.json" ;;
esac
