#!/usr/bin/env bash
# The GPU checks in parts that each fit one 10-minute device call on a fresh machine (there the fused_dense
# extension is built with nvcc at first use and the attention kernels autotune every size, so the whole
# suite does not fit one call). Logs and JSON results go to $OUT (default ./gpu-check).
#
#   bash scripts/gpu_check.sh tests-models   # GPU tests: generation, models, runtime, train, bench
#   bash scripts/gpu_check.sh tests-attention         # GPU tests: the attention kernels (Triton, decode, plans)
#   bash scripts/gpu_check.sh tests-attention-hopper  # GPU tests: FA2's API, TMA, the Gluon Hopper kernels
#   bash scripts/gpu_check.sh tests-kernels   # GPU tests: every other kernel (builds fused_dense)
#   bash scripts/gpu_check.sh bench-models   # bench bert (with ours+graphs), bench train (eager sides), bench overhead
#   bash scripts/gpu_check.sh bench-compile  # bench train with the torch.compile sides too
#   bash scripts/gpu_check.sh bench-loop [CASE...]  # the README's plain loop per real-vocabulary case, one process each
#   bash scripts/gpu_check.sh bench-sft      # the plain loop on SFT-style padded batches (the @sft cases)
#   bash scripts/gpu_check.sh bench-eval     # the evaluation forward of ours and HF (eval: sides), padded and not
#   bash scripts/gpu_check.sh bench-generate # bench generate (ours, HF, HF static)
#   bash scripts/gpu_check.sh bench-vit      # bench vit (ours, ours+graphs, timm eager, timm compile)
#   bash scripts/gpu_check.sh bench-ops      # bench ops, every group, eager (liger's side where its wheel is installed)
#   bash scripts/gpu_check.sh bench-ops-graphs  # bench ops, every group, timed by CUDA-graph replays
#   bash scripts/gpu_check.sh gemv           # batch-1 projections: cuBLAS vs our gemv kernel (scripts/profile/gemv_sweep.py)
#   bash scripts/gpu_check.sh activations    # GPU tests of the activations, linear_act and the inference MLP
#   bash scripts/gpu_check.sh gemv-chain     # every gemv config in a PDL chain with the block's fusions (gemv_chain_sweep.py)
#   bash scripts/gpu_check.sh decode-pdl     # programmatic dependent launch: GPU tests, bench generate ours vs ours-pdl, decode kernel tables
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.:kernels${PYTHONPATH:+:$PYTHONPATH}  # a caller's path kept: liger's wheel installed to a target folder
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
# A slow test prints its stack after 60 s instead of silently eating the call; -v names each test as it ends.
pytest_gpu() { timeout 560 python -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=60 --durations=15 "$@"; }
# The attention kernels autotune every shape their tests take on a fresh machine: the kernel tests run in three
# parts (all of them in one call ran past 540 s after 40 attention tests).
ATTENTION_TESTS=(tests/kernels/test_attention.py tests/kernels/test_attention_packed.py tests/kernels/test_launch_plans.py
                 tests/kernels/test_attention_decode.py tests/kernels/test_attention_dtypes.py)
HOPPER_TESTS=(tests/kernels/test_attention_fa2.py tests/kernels/test_attention_tma.py tests/kernels/test_attention_hopper.py
              tests/kernels/test_attention_hopper_bwd.py)

case "${1:-}" in
    tests-models)
        # (tests/hf needs trl, peft and datasets, which a bare GPU machine may lack: its two GPU files by name)
        pytest_gpu tests/generation tests/models tests/runtime tests/train tests/bench tests/test_backward_thread.py \
            tests/hf/test_hf_trainer.py 2>&1 | tee "$OUT/tests-models.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" ;;
    tests-attention)
        pytest_gpu "${ATTENTION_TESTS[@]}" 2>&1 | tee "$OUT/tests-attention.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" ;;
    tests-attention-hopper)
        pytest_gpu "${HOPPER_TESTS[@]}" 2>&1 | tee "$OUT/tests-attention-hopper.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" ;;
    tests-kernels)
        pytest_gpu tests/kernels $(printf -- '--ignore=%s ' "${ATTENTION_TESTS[@]}" "${HOPPER_TESTS[@]}") 2>&1 \
            | tee "$OUT/tests-kernels.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" ;;
    bench-models)
        timeout 200 python -m flash_models bench bert --models bert-base --repeats 10 --out "$OUT" 2>&1 | tee "$OUT/bench-bert.log" | grep "^|"
        timeout 200 python -m flash_models bench train --cases gpt2,llama-1b --sides ours,hf --steps 8 --warmup 3 \
            --out "$OUT/train.json" 2>&1 | tee "$OUT/bench-train.log" | grep "^|"
        timeout 90 python -m flash_models bench overhead --out "$OUT" 2>&1 | tee "$OUT/bench-overhead.log" | grep "^|" ;;
    bench-compile)
        timeout 560 python -m flash_models bench train --cases gpt2,llama-1b --sides ours,ours+compile,hf+compile \
            --steps 8 --warmup 3 --out "$OUT/train-compile.json" 2>&1 | tee "$OUT/bench-compile.log" | grep "^|" ;;
    bench-loop)
        # One process per case, back to back (an eager step bound by the host reads slower while anything else runs
        # there), then one result for the page. Each case takes 1-2 minutes, so a call fits about four.
        shift
        for case in ${@:-gpt2 gpt2-medium smollm2-135m qwen2-0.5b}; do
            timeout 200 python -m flash_models bench train --cases "$case" --sides loop:ours,loop:hf,loop:hf+compile \
                --steps 8 --warmup 3 --out "$OUT/loop-$case.json" 2>&1 | tee -a "$OUT/bench-loop.log" | grep "^|"
        done
        python -m flash_models.bench.page --merge "$OUT/train.json" "$OUT"/loop-*.json ;;
    bench-sft)
        # The loop on SFT-style padded batches (right padding, labels -100 there): ours runs the real tokens only.
        timeout 560 python -m flash_models bench train --cases llama-1b@sft,smollm2-360m@sft \
            --sides loop:ours,loop:hf,loop:hf+compile --steps 8 --warmup 3 --out "$OUT/train-sft.json" 2>&1 \
            | tee "$OUT/bench-sft.log" | grep "^|" ;;
    bench-eval)
        # The evaluation forward (eval mode, no grad, logits and loss) on padded and unpadded batches.
        timeout 560 python -m flash_models bench train --cases llama-1b@sft,smollm2-360m@sft,llama-1b \
            --sides eval:ours,eval:hf --steps 8 --warmup 3 --out "$OUT/train-eval.json" 2>&1 \
            | tee "$OUT/bench-eval.log" | grep "^|" ;;
    bench-generate)
        timeout 560 python -m flash_models bench generate --batches 1 16 --prompts 128 512 --repeats 3 --out "$OUT" 2>&1 \
            | tee "$OUT/bench-generate.log" | grep "^|" ;;
    bench-vit)
        timeout 560 python -m flash_models bench vit --out "$OUT" 2>&1 | tee "$OUT/bench-vit.log" | grep "^|" ;;
    bench-ops)
        timeout 560 python -m flash_models bench ops --out "$OUT/ops.json" 2>&1 | tee "$OUT/bench-ops.log" | grep "^|" ;;
    bench-ops-graphs)
        timeout 560 python -m flash_models bench ops --graphs --out "$OUT/ops-graphs.json" 2>&1 \
            | tee "$OUT/bench-ops-graphs.log" | grep "^|" ;;
    gemv)
        pytest_gpu tests/kernels/test_gemv.py 2>&1 | tee "$OUT/tests-gemv.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
        timeout 200 python scripts/profile/gemv_sweep.py 2>&1 | tee "$OUT/gemv-sweep.log" | grep "^|" ;;
    gemv-chain)
        timeout 500 python scripts/profile/gemv_chain_sweep.py 2>&1 | tee "$OUT/gemv-chain.log" | grep -E "^\||copy" ;;
    activations)
        pytest_gpu tests/kernels/test_activations.py tests/kernels/test_linear_act.py tests/models/test_mlp_inference.py 2>&1 \
            | tee "$OUT/tests-activations.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" ;;
    decode-pdl)
        pytest_gpu tests/kernels/test_attention_decode.py tests/generation/test_generate_gpu.py tests/runtime/test_decode_chain.py \
            -k "programmatic or real_sizes" \
            2>&1 | tee "$OUT/tests-decode-pdl.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
        timeout 240 python -m flash_models bench generate --models llama-1.1b gpt2-124m --batches 1 16 --prompts 128 \
            --peers ours-pdl --repeats 3 --out "$OUT" 2>&1 | tee "$OUT/bench-generate-pdl.log" | grep "^|"
        for mode in plain pdl; do timeout 90 python scripts/profile/decode_kernels.py llama-1.1b 1 $mode; done \
            2>&1 | tee "$OUT/decode-kernels-pdl.log" | grep -E "kernels and|us/step" | head -40 ;;
    *)
        echo "usage: bash scripts/gpu_check.sh {tests-models|tests-attention|tests-attention-hopper|tests-kernels|bench-models|bench-compile|bench-loop [CASE...]|bench-sft|bench-eval|bench-generate|bench-vit|bench-ops|bench-ops-graphs|gemv|gemv-chain|activations|decode-pdl}" >&2
        exit 2 ;;
esac
