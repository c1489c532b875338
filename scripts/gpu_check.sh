#!/usr/bin/env bash
# Conveyor's GPU check: every GPU path, on a machine with an NVIDIA GPU, from the repository root.
#
#   scripts/gpu_check.sh [OUTPUT_FOLDER]      (default gpu-check/)
#
# On one H200 (2026-11-28) the training steps took about 4.5 minutes, pytest -m gpu 84 s and the overhead
# benchmark 1.5 minutes; the models benchmark was not run there.
#
# Runs the README's main job as typed, every schedule on one worker, several workers sharing the GPU (gloo),
# stragglers and elastic training on the GPU, a Hugging Face GPT-2 split by torch.export, --power-limit auto
# long enough to choose a limit, the tests marked gpu, and the overhead and models benchmarks on CUDA. Each step's output goes to OUTPUT_FOLDER/STEP.log; the
# benchmark's JSON and plot, and every run's summary, go there too. The last lines say which steps passed;
# the exit status is the number that failed. Uses the Python on PATH: where `import conveyor` fails it runs
# `pip install -e ".[test]"` first (with a CUDA build of PyTorch already installed, that keeps it).
# GPU_CHECK_SKIP="pytest-gpu overhead" leaves out the steps it names (to run them apart, or in parallel); the
# last lines list them. Leaving out power-limit-auto leaves out power-limit-chosen, which reads its summary.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False): nothing to check" >&2
    exit 2
fi
python -c "import conveyor" 2>/dev/null || pip install -q -e ".[test]" || exit 2
python - <<'PY' | tee "$out/machine.txt"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s):",
      ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
PY

passed=() failed=() skipped=()
step() {  # step NAME COMMAND...: run it, log it, remember how it went
    local name=$1
    shift
    local skip=" ${GPU_CHECK_SKIP:-} "
    [[ $skip == *" power-limit-auto "* ]] && skip+="power-limit-chosen "
    if [[ $skip == *" $name "* ]]; then
        skipped+=("$name")
        return
    fi
    local began=$SECONDS
    echo "== $name: $*"
    if "$@" >"$out/$name.log" 2>&1; then
        passed+=("$name ($((SECONDS - began)) s)")
    else
        failed+=("$name ($((SECONDS - began)) s, exit $?)")
        tail -n 5 "$out/$name.log"
    fi
}
train() {  # train RUN_NAME OPTIONS...: conveyor train into OUTPUT_FOLDER/RUN_NAME, its summary kept
    local name=$1
    shift
    conveyor train --run-dir "$out/runs/$name" --json "$out/$name.json" "$@"
}

# The README's main job, as typed: one worker per GPU, NCCL.
step readme-job conveyor train --run-dir "$out/runs/readme-job" --json "$out/readme-job.json"
# Every schedule on one worker.
for schedule in gpipe flush pipedream pipedream-vs 2bw; do
    step "schedule-$schedule" train "schedule-$schedule" --workers 1 --stages 1 --schedule "$schedule" --epochs 1
done
# Several workers sharing the GPU (gloo; activations and gradients through pinned host memory).
step shared-planned train shared-planned --backend gloo --workers 4 --epochs 2
step shared-pipedream train shared-pipedream --backend gloo --stages 2 --replicas 2-1 --schedule pipedream --epochs 2
step shared-stragglers train shared-stragglers --backend gloo --stages 1 --replicas 2 --stragglers flexrr --epochs 2
step shared-backup train shared-backup --backend gloo --stages 1 --replicas 2 --stragglers backup --chunks 4 --epochs 2
step shared-elastic train shared-elastic --backend gloo --workers 3 --reliable 1 --epochs 2
step shared-bf16 train shared-bf16 --backend gloo --model gpt --stages 2 --autocast bf16 --epochs 1
# Users' own models, split by torch.export: GPT-2 from transformers' class, one worker, then two stages sharing it.
gpt2_args="n_layer=4,n_embd=256,n_head=4,vocab_size=101,bos_token_id=0,eos_token_id=0"
step split-gpt2 train split-gpt2 --model transformers:GPT2LMHeadModel --model-args "$gpt2_args" --dataset text --workers 1 --epochs 2
step split-gpt2-stages train split-gpt2-stages --model transformers:GPT2LMHeadModel --model-args "$gpt2_args" --dataset text --backend gloo --stages 2 --epochs 2
# The same built on the meta device, each worker making only its stage real on the GPU (initialised there).
step split-gpt2-meta train split-gpt2-meta --model transformers:GPT2LMHeadModel --model-args "$gpt2_args" --dataset text --backend gloo --stages 2 --materialize stage --epochs 2
# --power-limit auto: batches of 8 make 180 steps an epoch, three limits profiled per epoch.
step power-limit-auto train power-limit-auto --workers 1 --power-limit auto --batch-size 8 --epochs 10
step power-limit-chosen python -c "
import json, sys
s = json.load(open('$out/power-limit-auto.json'))
print('chosen', s.get('power_limit_w'), 'W from', len(s.get('power_profile', [])), 'limits')
sys.exit(0 if s.get('power_limit_w') else 1)"
# The tests that need a GPU.
step pytest-gpu python -m pytest -m gpu -q -p no:cacheprovider
# One worker against a plain PyTorch loop, on CUDA (one run of each here; the README's figures take 3).
step overhead conveyor bench overhead --devices cuda --repeats 1 --json "$out/overhead.json" --plot "$out/overhead.png"
# Users' models split against unsplit (the plain loops on the GPU; four workers share it over gloo).
step models conveyor bench models --json "$out/models.json"

echo
echo "passed: ${#passed[@]}"
printf '  %s\n' "${passed[@]}"
echo "failed: ${#failed[@]}"
[ ${#failed[@]} -eq 0 ] || printf '  %s\n' "${failed[@]}"
[ ${#skipped[@]} -eq 0 ] || echo "skipped (GPU_CHECK_SKIP): ${skipped[*]}"
exit ${#failed[@]}
