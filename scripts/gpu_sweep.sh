#!/usr/bin/env bash
# The GPU runs of the benchmark issue, for the lent GPU machine (CUDA and PyTorch, no Rust, no network).
# Build and pack here first (docs/cuda.md):
#
#   . ../shared/cuda/env.sh
#   CARGO_TARGET_DIR=target-cuda cargo build --release -p streambp-bench -p streambp-train \
#       --features streambp-bench/cuda,streambp-train/cuda
#   CARGO_TARGET_DIR=target-cuda cargo test --release -p streambp-core --features cuda --test cuda_parity --no-run
#   scripts/gpu_sweep.sh pack        # -> gpu/*.xz (ignored by git), plus the transformers peer script
#
# then carry `gpu` and run one step per device call (each stays under the 10-minute limit), from the
# repository root: `scripts/gpu_sweep.sh parity|train|time|maxt|long|peer`. Results go to $OUT (or gpu-out),
# JSON lines written as each point finishes, so a step cut off by the time limit keeps what it measured.
set -euo pipefail

step=${1:?usage: gpu_sweep.sh pack|parity|train|time|maxt|long|peer}
out=${OUT:-gpu-out}
config=benches/configs/qwen3-8b.json
bench=gpu/streambp-bench

unpack() {
    for f in gpu/*.xz; do
        [ -e "${f%.xz}" ] || xz -dk "$f"
    done
    chmod +x gpu/streambp-bench gpu/streambp-train gpu/cuda_parity
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/card.csv"
}

case "$step" in
pack)
    mkdir -p gpu
    xz -T2 -6 -c target-cuda/release/streambp-bench > gpu/streambp-bench.xz
    xz -T2 -6 -c target-cuda/release/streambp-train > gpu/streambp-train.xz
    test_bin=$(ls -t target-cuda/release/deps/cuda_parity-* | grep -v '\.d$' | head -1)
    xz -T2 -6 -c "$test_bin" > gpu/cuda_parity.xz
    cp ../shared/cuda/peer_transformers.py gpu/
    du -sh gpu
    ;;
parity)
    # CUDA vs CPU: loss and every gradient of the four fixture families, f32, all modes.
    unpack
    STREAMBP_FIXTURES=tests/fixtures gpu/cuda_parity --nocapture 2>&1 | tee "$out/cuda_parity.txt"
    ;;
train)
    # The trainer on the card: the built-in SFT run (full, then LoRA), DPO and GRPO, a few steps each;
    # their losses set beside the CPU's same runs (the first steps agree to f32 rounding).
    unpack
    train=gpu/streambp-train
    for job in "sft --max-steps 60" "sft --max-steps 60 --lora-r 8" "dpo --max-steps 20" \
        "grpo --max-steps 4 --batch-size 8"; do
        name=$(echo "$job" | tr -d ' -' | cut -c1-24)
        echo "== $job" | tee -a "$out/train.log"
        # shellcheck disable=SC2086
        timeout "${LIMIT:-120}" "$train" $job --device cuda --output-dir "/tmp/run-$name" \
            --overwrite-output-dir 2>&1 | tr '\r' '\n' | tail -8 | tee -a "$out/train.log" || true
        head -4 "/tmp/run-$name/metrics.jsonl" >> "$out/train.log" 2>/dev/null || true
    done
    ;;
time)
    # Qwen3-8B, bf16, one backward per mode at fixed T (the peers' lengths), side by side.
    unpack
    timeout "${LIMIT:-570}" "$bench" --config "$config" --device cuda --dtype bf16 \
        --seq-lens "${SEQS:-16384,24576}" --repeats "${REPEATS:-1}" \
        --chunk 2048 --logits-chunk 1024 --modes "${MODES:-stream,checkpoint,full}" \
        --json "$out/time.jsonl" 2>&1 | tee "$out/time.md"
    ;;
maxt)
    # Longest T that fits the card per mode (out-of-memory counts as over; stream's chunks planned),
    # searched up to T_MAX: past it a backward takes minutes, and `--predict` sizes it instead.
    unpack
    timeout "${LIMIT:-570}" "$bench" --config "$config" --device cuda --dtype bf16 \
        --max-t-budget 78GiB --t-step 8192 --t-max "${T_MAX:-65536}" \
        --modes "${MODES:-checkpoint,stream}" 2>&1 | tee "$out/maxt.md"
    ;;
long)
    # Past the paper: T = 229,376 (224k) with the layer checkpoints in host memory, on the first
    # LAYERS decoder layers of Qwen3-8B (the whole depth takes too long for one call). Every layer has
    # the same shapes, so the 36-layer peak is at most this peak plus the other layers' weights and
    # gradients (offloaded checkpoints are not on the card), and its time about the layers' share
    # scaled to 36 (docs/benchmarks.md).
    unpack
    timeout "${LIMIT:-570}" "$bench" --config "$config" --device cuda --dtype bf16 \
        --layers "${LAYERS:-2}" --seq-lens "${SEQS:-229376}" --chunk 8192 --logits-chunk 4096 \
        --modes stream --offload-checkpoints --json "$out/long.jsonl" 2>&1 | tee "$out/long.md"
    ;;
peer)
    # transformers with gradient checkpointing on the same config, same card.
    unpack
    timeout "${LIMIT:-570}" /opt/torch/.venv/bin/python gpu/peer_transformers.py --config "$config" --mode gc \
        --seqs "${SEQS:-4096,16384,24576,28672,32768}" 2>&1 | tee "$out/peer_gc.jsonl"
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
