#!/usr/bin/env bash
# The checks a session lent a GPU machine runs, as one prepared command (device time is short:
# 15 minutes a task, the machine's start included). From the repository root, on that machine:
#
#     bash benchmarks/gpu_session.sh tests    # the gpu-marked tests: 4 minutes at most
#     bash benchmarks/gpu_session.sh bench    # the GPU benchmarks: 9 minutes at most
#     bash benchmarks/gpu_session.sh smoke    # here, on a CPU: every step at its smallest
#
# Each mode fits one call of the device tool (10 minutes a command): give `tests` a timeout_s
# of 300 and `bench` 600, one call right after the other while the machine is warm.
#
# It needs no install: the checkout is put on PYTHONPATH and the machine's own torch is used
# (its image has pytest, hypothesis, scikit-learn, transformers and peft; nothing here needs
# Optuna or Ray). Every step runs under its own time limit, so a hung step costs its limit and
# not the session, and after every step what was written so far is packed into
# $OUT/gpu_session.tgz (the device tool brings back at most 8 files) beside
# $OUT/gpu_session.log. Results land in the archive's results/ folder under the names
# benchmarks/results/ uses; copy the ones worth keeping there and commit them with the command.
set -u
mode=${1:-}
case "$mode" in
tests | bench | smoke) ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh tests|bench|smoke (got '$mode')" >&2
    exit 2
    ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
work=$(mktemp -d)
mkdir -p "$work/results"
log=$OUT/gpu_session.log
: >"$log"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
failed=0

if [ "$mode" = smoke ]; then
    device=cpu
    scale=5 # a 2-core CPU starts processes and compiles far slower than the GPU machine
    # the smallest of every step: proves the commands and their flags, measures nothing
    throughput_args=(--sizes 2 --rounds 1 --min-time 0.05 --max-processes 2)
    throughput_models=(tiny_mlp)
    compile_args=(--models tiny_mlp --sizes 2 --rounds 1 --round-s 0.05 --warmup 1)
    offload_args=(--layers 2 --width 64 --size 2 --batch 8 --steps 1 --rounds 1)
    tests=(tests/fusion/test_gpu.py)
else
    device=cuda
    scale=1
    throughput_args=(--sizes 1 8 32 --rounds 3 --max-processes 8)
    throughput_models=(tiny_mlp medium_mlp small_cnn cifar_resnet transformer)
    compile_args=(--models tiny_mlp medium_mlp small_cnn transformer --sizes 8 32 --rounds 3)
    offload_args=(--layers 8 --width 2048 --size 8 --batch 256 --steps 3 --rounds 3)
    tests=(
        tests/fusion/test_gpu.py tests/fusion/test_compile.py tests/training/test_gpu_training.py
        tests/offload/test_offload_gpu.py tests/test_profiler.py
    )
fi

pack() {
    cp "$log" "$work/" 2>/dev/null
    tar czf "$OUT/gpu_session.tgz" -C "$work" . 2>/dev/null || true
}

# step NAME SECONDS COMMAND...: run COMMAND (in benchmarks/ for the scripts) under a time
# limit, its output appended to the log, then pack what exists
step() {
    local name=$1 limit=$(($2 * scale)) rc
    shift 2
    echo "=== $name: start $(date -u +%T), limit ${limit}s" | tee -a "$log"
    timeout --signal=INT --kill-after=20 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "=== $name: rc $rc at $(date -u +%T)" | tee -a "$log"
    [ "$rc" = 0 ] || failed=1
    pack
}

{
    echo "mode $mode, device $device, $(date -u)"
    nvidia-smi -L 2>&1 || true
    "$python" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    git -C "$root" log -1 --format='commit %H %s' 2>/dev/null || true
} >>"$log" 2>&1

if [ "$mode" = tests ] || [ "$mode" = smoke ]; then
    step "pytest -m gpu" 240 "$python" -m pytest -m gpu -q -p no:cacheprovider \
        --junitxml="$work/gpu_tests.xml" "${tests[@]/#/$root/}"
fi
if [ "$mode" = bench ] || [ "$mode" = smoke ]; then
    cd "$root/benchmarks" || exit 1
    for model in "${throughput_models[@]}"; do
        step "fusion_throughput $model" 75 "$python" fusion_throughput.py --device "$device" \
            --models "$model" "${throughput_args[@]}" \
            --out "$work/results/fusion_throughput_${device}_$model"
    done
    step "offload_step" 50 "$python" offload_step.py --device "$device" "${offload_args[@]}" \
        --out "$work/results/offload_step_$device"
    step "compile_fused" 130 "$python" compile_fused.py --device "$device" "${compile_args[@]}" \
        --out "$work/results/compile_fused_$device"
fi
echo "=== done: $([ $failed = 0 ] && echo 'every step passed' || echo 'some step failed')" \
    | tee -a "$log"
pack
exit $failed
