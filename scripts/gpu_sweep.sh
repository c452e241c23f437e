#!/usr/bin/env bash
# The GPU runs of the benchmark issue, for the lent GPU machine (CUDA and PyTorch, no Rust, no network).
# Build and pack here first (docs/cuda.md):
#
#   . ../shared/cuda/env.sh
#   CARGO_TARGET_DIR=target-cuda cargo build --release -p streambp-bench -p streambp-train \
#       --features streambp-bench/cuda,streambp-train/cuda
#   CARGO_TARGET_DIR=target-cuda cargo test --release -p streambp-core --features cuda --test cuda_parity --no-run
#   CARGO_TARGET_DIR=target-cuda cargo test --release -p streambp-kernels --features cuda --test cuda_attention --test cuda_elementwise --no-run
#   CARGO_TARGET_DIR=target-cuda cargo build --release -p streambp-kernels --features cuda --example attention_card
#   scripts/gpu_sweep.sh pack        # -> gpu/*.xz (ignored by git), plus the transformers peer script
#
# then carry `gpu` and run one step per device call (each stays under the 10-minute limit), from the
# repository root: `scripts/gpu_sweep.sh parity|train|time|maxt|long|peer|disk|profile|cpu|attention|card-step`
# (`attention`: the fused kernels' step of issues 59 and 60, all in one call; `card-step`: issue 60's
# whole step beside the peer and the trainer on the card, in one call), or, for
# the host CPU alone, `pack-cpu` here and `cpu-profile` there (carry gpu-cpu), or `pack-cpu` and
# `pack-suite` here and `host-session` there (the whole test suite too). Results go to $OUT (or
# gpu-out), JSON lines written as each point finishes, so a step cut off by the time limit keeps what
# it measured.
set -euo pipefail

step=${1:?usage: gpu_sweep.sh pack|parity|train|time|maxt|long|peer|disk|profile|cpu|attention|card-step|pack-cpu|cpu-profile|pack-suite|suite|session|host-session}
out=${OUT:-gpu-out}
config=benches/configs/qwen3-8b.json
bench=${BENCH:-gpu/streambp-bench}
# What `cpu-profile` runs from its kit (gpu-cpu/): each as `NAME.xz` (`pack-cpu`), or a link into
# `pack-suite`'s archive.
kit_tools=(streambp-bench op_timings planner kernels_lib half_layers bf16_kernel_choice)

unpack() {
    for f in gpu/*.xz; do
        [ -e "$f" ] || continue
        [ -e "${f%.xz}" ] || xz -dk "$f"
    done
    # Each binary only where it was carried (the working tree that travels is limited in size).
    for f in gpu/streambp-bench gpu/streambp-bench-pageable gpu/streambp-train gpu/cuda_parity \
        gpu/cuda_attention gpu/cuda_elementwise gpu/attention_card; do
        [ ! -e "$f" ] || chmod +x "$f"
    done
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/card.csv" || true
}

# The peer's Python: the lent machines' torch install, else this machine's python3.
peer_python() {
    if [ -x /opt/torch/.venv/bin/python ]; then
        echo /opt/torch/.venv/bin/python
    else
        echo python3
    fi
}

# The seconds a run may take: `$1`, or less where a session's DEADLINE (epoch seconds) comes
# sooner, so that no run outlives the session that started it.
limit() {
    local seconds=$1
    if [ -n "${DEADLINE:-}" ]; then
        local left=$((DEADLINE - $(date +%s)))
        [ "$left" -ge "$seconds" ] || seconds=$left
    fi
    [ "$seconds" -ge 1 ] || seconds=1
    echo "$seconds"
}

# `pack-suite`'s archive, unpacked once: the tests find their fixtures and the binaries they start at
# the paths they were built at (`$built`), linked to this folder where they do not exist; the kit's
# names for what `cpu-profile` runs point into it.
unpack_suite() {
    built=$(cat gpu-cpu/suite-root)
    # Again wherever the archive is not the one unpacked last (a warm machine keeps target/).
    local stamp
    stamp=$(cksum < gpu-cpu/suite.tar.xz)
    if [ "$(cat target/.suite-stamp 2>/dev/null)" != "$stamp" ]; then
        tar xJf gpu-cpu/suite.tar.xz
        echo "$stamp" > target/.suite-stamp
    fi
    if [ "$built" != "$PWD" ] && [ ! -e "$built" ]; then
        mkdir -p "$(dirname "$built")" && ln -s "$PWD" "$built"
    fi
    ln -sf "$PWD/target/release/streambp-bench" gpu-cpu/streambp-bench
    ln -sf "$PWD/target/release/examples/op_timings" gpu-cpu/op_timings
    for name in planner:planner streambp_kernels:kernels_lib half_layers:half_layers \
        bf16_kernel_choice:bf16_kernel_choice; do
        ln -sf "$PWD/$(awk -v n="${name%%:*}" '$3 == n {print $1}' gpu-cpu/suite.txt)" \
            "gpu-cpu/${name##*:}"
    done
}

# A session's start: the host's CPU, cores and memory in host.txt, and its DEADLINE, SESSION_LIMIT
# seconds on, for every run it starts.
start_session() {
    {
        grep -m1 'model name' /proc/cpuinfo || true
        nproc
        free -g | head -2
    } > "$out/host.txt"
    DEADLINE=$(($(date +%s) + ${SESSION_LIMIT:-450}))
    export DEADLINE
}

# What a session's steps wrote under $out, as one results.tgz (a call brings back at most 8 files).
bundle() {
    cd "$out" || return
    # Exit status 1: a file changed while it was read (a run cut off at the deadline).
    local status=0
    tar czf /tmp/results.tgz --warning=no-file-changed . || status=$?
    if [ "$status" -le 1 ]; then
        find . -type f -delete
        mv /tmp/results.tgz .
    fi
    ls -la
}

case "$step" in
pack)
    mkdir -p gpu
    xz -T2 -6 -c target-cuda/release/streambp-bench > gpu/streambp-bench.xz
    xz -T2 -6 -c target-cuda/release/streambp-train > gpu/streambp-train.xz
    test_bin=$(ls -t target-cuda/release/deps/cuda_parity-* | grep -v '\.d$' | head -1)
    xz -T2 -6 -c "$test_bin" > gpu/cuda_parity.xz
    for test in cuda_attention cuda_elementwise; do
        test_bin=$(ls -t target-cuda/release/deps/$test-* | grep -v '\.d$' | head -1)
        xz -T2 -6 -c "$test_bin" > gpu/$test.xz
    done
    xz -T2 -6 -c target-cuda/release/examples/attention_card > gpu/attention_card.xz
    cp ../shared/cuda/peer_transformers.py gpu/
    du -sh gpu
    ;;
parity)
    # CUDA vs CPU: loss and every gradient of the four fixture families, f32, all modes.
    unpack
    STREAMBP_FIXTURES=tests/fixtures timeout "$(limit "${LIMIT:-300}")" gpu/cuda_parity --nocapture 2>&1 \
        | tee "$out/cuda_parity.txt"
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
        timeout "$(limit "${LIMIT:-120}")" "$train" $job --device cuda --output-dir "/tmp/run-$name" \
            --overwrite-output-dir 2>&1 | tr '\r' '\n' | tail -8 | tee -a "$out/train.log" || true
        head -4 "/tmp/run-$name/metrics.jsonl" >> "$out/train.log" 2>/dev/null || true
    done
    ;;
time)
    # Qwen3-8B, bf16, one backward per mode at fixed T (the peers' lengths), side by side.
    unpack
    timeout "$(limit "${LIMIT:-570}")" "$bench" --config "$config" --device cuda --dtype bf16 \
        --seq-lens "${SEQS:-16384,24576}" --repeats "${REPEATS:-1}" \
        --chunk 2048 --logits-chunk 1024 --modes "${MODES:-stream,checkpoint,full}" \
        --json "$out/time.jsonl" 2>&1 | tee "$out/time.md"
    ;;
maxt)
    # Longest T that fits the card per mode (out-of-memory counts as over; stream's chunks planned),
    # searched up to T_MAX: past it a backward takes minutes, and `--predict` sizes it instead.
    unpack
    timeout "$(limit "${LIMIT:-570}")" "$bench" --config "$config" --device cuda --dtype bf16 \
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
    timeout "$(limit "${LIMIT:-570}")" "$bench" --config "$config" --device cuda --dtype bf16 \
        --layers "${LAYERS:-2}" --seq-lens "${SEQS:-229376}" --chunk 8192 --logits-chunk 4096 \
        --modes stream --offload-checkpoints --json "$out/long.jsonl" 2>&1 | tee "$out/long.md"
    ;;
peer)
    # transformers with gradient checkpointing on the same config, same card.
    unpack
    timeout "$(limit "${LIMIT:-570}")" /opt/torch/.venv/bin/python gpu/peer_transformers.py \
        --config "$config" --mode gc --seqs "${SEQS:-4096,16384,24576,28672,32768}" 2>&1 | tee "$out/peer_gc.jsonl"
    ;;
disk)
    # Issue 28 on the card: one stream backward of Qwen3-8B's first LAYERS layers (bf16, T = SEQS)
    # with the layer checkpoints on the card, in host memory, and in a scratch file on this
    # machine's disk (pinned host buffers between file and card), every layer and every second
    # one; gpu/streambp-bench-pageable, when packed, is the build before the pinned buffers.
    unpack
    scratch=${SCRATCH:-$PWD/ckpt-scratch}
    mkdir -p "$scratch"
    df -h "$scratch" /tmp | tee "$out/disk.md"
    n=0
    for run in "$bench|" "$bench|--offload-checkpoints" "$bench|--checkpoint-dir $scratch" \
        "$bench|--checkpoint-dir $scratch --checkpoint-every 2" \
        "gpu/streambp-bench-pageable|--checkpoint-dir $scratch"; do
        binary=${run%%|*}
        [ -x "$binary" ] || continue
        n=$((n + 1))
        echo "== $binary ${run#*|}" | tee -a "$out/disk.md"
        rm -f "/tmp/disk$n.jsonl"
        # shellcheck disable=SC2086
        timeout "$(limit "${LIMIT:-240}")" "$binary" --config "$config" --device cuda --dtype bf16 \
            --layers "${LAYERS:-4}" --seq-lens "${SEQS:-32768}" --chunk 2048 --logits-chunk 1024 \
            --modes stream --repeats "${REPEATS:-1}" ${run#*|} --json "/tmp/disk$n.jsonl" 2>&1 \
            | tee -a "$out/disk.md" || true
        cat "/tmp/disk$n.jsonl" >> "$out/disk.jsonl" 2>/dev/null || true
    done
    ;;
profile)
    # Where the card's time goes in one layer's stream backward (the attention op's composed path
    # is the suspect, docs/cuda.md): the bench's own parts (`--op-times`: the engine's and the
    # attention op's steps, each synchronised) at T = 4096 and 16,384, then Nsight Systems' kernel
    # and memory-copy summaries where `nsys` exists (it did not on the H200 machines).
    unpack
    timeout "$(limit "${LIMIT:-240}")" "$bench" --config "$config" --device cuda --dtype bf16 --layers 1 \
        --seq-lens "${SEQS:-4096,16384}" --chunk 2048 --logits-chunk 1024 --modes stream,checkpoint \
        --repeats 2 --op-times --json "$out/op_times.jsonl" > "$out/op_times.txt" 2>&1 || true
    nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys \
        /usr/local/cuda/nsight-systems-*/bin/nsys 2>/dev/null | head -1 || true)
    if [ -z "$nsys" ]; then
        echo "no nsys on this machine" | tee "$out/profile.txt"
        exit 0
    fi
    timeout "$(limit "${LIMIT:-240}")" "$nsys" profile -o /tmp/streambp-profile --force-overwrite true \
        "$bench" --config "$config" --device cuda --dtype bf16 --layers 1 --seq-lens "${NSYS_SEQS:-16384}" \
        --chunk 2048 --logits-chunk 1024 --modes stream --repeats 1 > "$out/profile.txt" 2>&1 || true
    "$nsys" stats --report cuda_gpu_kern_sum --report cuda_gpu_mem_time_sum --report cuda_api_sum \
        --format csv --output - /tmp/streambp-profile.nsys-rep 2>/dev/null | head -120 >> "$out/profile.txt" || true
    ;;
attention)
    # Issues 59 and 60 in one device call (within one call's time limit; results.tgz in $OUT): the fused kernels
    # against the CPU and the composed ops (cuda_attention; RMSNorm and the gated activations:
    # cuda_elementwise), the whole model's parity with them in force
    # (cuda_parity), one chunk's attention timed beside PyTorch's SDPA on the same shapes, and one
    # Qwen3-8B layer's step at 4K and 16K with --op-times (stream and checkpoint).
    unpack
    start_session
    trap bundle EXIT
    timeout "$(limit 120)" gpu/cuda_attention --nocapture > "$out/cuda_attention.txt" 2>&1 || true
    timeout "$(limit 60)" gpu/cuda_elementwise --nocapture > "$out/cuda_elementwise.txt" 2>&1 || true
    STREAMBP_FIXTURES=tests/fixtures timeout "$(limit 150)" gpu/cuda_parity --nocapture \
        > "$out/cuda_parity.txt" 2>&1 || true
    timeout "$(limit 90)" gpu/attention_card > "$out/attention_card.jsonl" 2> "$out/attention_card.err" || true
    timeout "$(limit 90)" "$(peer_python)" scripts/sdpa_peer.py > "$out/sdpa_peer.jsonl" \
        2> "$out/sdpa_peer.err" || true
    LIMIT=200 "$0" profile > "$out/profile.log" 2>&1 || true
    ;;
card-step)
    # Issue 60 in one device call (results.tgz in $OUT): Qwen3-8B bf16 on the card at 16K and 24K,
    # one backward per mode (stream, checkpoint) with the trainer's AdamW step after it, beside
    # transformers + gradient checkpointing's forward and backward on the same card (its first
    # length, 4K, is its warm-up), then the trainer's built-in SFT run on the card, full and LoRA
    # (losses beside the CPU's: docs/cuda.md, "First run on a GPU").
    unpack
    start_session
    trap bundle EXIT
    timeout "$(limit 240)" "$bench" --config "$config" --device cuda --dtype bf16 \
        --seq-lens "${SEQS:-16384,24576}" --repeats 1 --chunk 2048 --logits-chunk 1024 \
        --modes stream,checkpoint --optimizer-step --json "$out/time.jsonl" > "$out/time.md" 2>&1 || true
    timeout "$(limit 120)" "$(peer_python)" gpu/peer_transformers.py --config "$config" --mode gc \
        --seqs "4096,${SEQS:-16384,24576}" > "$out/peer_gc.jsonl" 2> "$out/peer_gc.err" || true
    for job in "sft --max-steps 60" "sft --max-steps 60 --lora-r 8"; do
        name=$(echo "$job" | tr -d ' -' | cut -c1-24)
        echo "== $job" >> "$out/train.log"
        # shellcheck disable=SC2086
        timeout "$(limit 60)" gpu/streambp-train $job --device cuda --output-dir "/tmp/run-$name" \
            --overwrite-output-dir 2>&1 | tr '\r' '\n' | tail -8 >> "$out/train.log" || true
        cp "/tmp/run-$name/metrics.jsonl" "$out/metrics-$name.jsonl" 2>/dev/null || true
    done
    ;;
cpu)
    # Issue 25 on this host's CPU: the qwen3-small step beside transformers, both sides on the same
    # two cores (CORES), f32 then bf16; the bench writes the tables with the CPU's name and flags.
    unpack
    py=$(peer_python)
    for dtype in f32 bf16; do
        timeout "$(limit "${LIMIT:-240}")" taskset -c "${CORES:-0,1}" "$bench" \
            --config benches/configs/qwen3-small.json --dtype "$dtype" --seq-lens 2048,4096 \
            --modes stream --chunk 128 --repeats "${REPEATS:-3}" --peer "$py" \
            --peer-script scripts/peer_bench.py --peer-doc "$out/peer.md" 2>&1 | tee -a "$out/cpu.log" || true
    done
    ;;
pack-cpu)
    # The kit for `cpu-profile` (gpu-cpu/, ignored): the CPU build of the bench and of op_timings,
    # and this machine's perf with every library it links, run through the loader carried with them
    # (the lent machines have no perf), and the planner's test. Build first:
    #   cargo build --release -p streambp-bench
    #   cargo build --release -p streambp-kernels --example op_timings
    #   cargo test --release -p streambp-core --test planner --no-run
    #   cargo test --release -p streambp-kernels --lib --no-run
    #   cargo test --release -p streambp-models --test half_layers --test bf16_kernel_choice --no-run
    rm -rf gpu-cpu /tmp/perf-kit && mkdir -p gpu-cpu /tmp/perf-kit/perf/lib
    xz -T2 -6 -c target/release/streambp-bench > gpu-cpu/streambp-bench.xz
    xz -T2 -6 -c target/release/examples/op_timings > gpu-cpu/op_timings.xz
    test_bin=$(ls -t target/release/deps/planner-* | grep -v '\.d$' | head -1)
    xz -T2 -6 -c "$test_bin" > gpu-cpu/planner.xz
    # The kernels' unit tests and the bf16 layers' and kernel choice's tests: the bf16 kernels (AMX's
    # among them) against exact sums, and the layers with the kernel that CPU chooses in force.
    for test in streambp_kernels:kernels_lib half_layers:half_layers bf16_kernel_choice:bf16_kernel_choice; do
        test_bin=$(ls -t target/release/deps/"${test%%:*}"-* | grep -v '\.d$' | head -1)
        xz -T2 -6 -c "$test_bin" > gpu-cpu/"${test##*:}".xz
    done
    perf_bin=$(command -v perf) || {
        echo "pack-cpu: no perf on this machine (apt-get install linux-perf)" >&2
        exit 1
    }
    cp -L "$perf_bin" /tmp/perf-kit/perf/
    for lib in $(ldd "$perf_bin" | awk '/=>/ {print $3}') /lib64/ld-linux-x86-64.so.2; do
        cp -L "$lib" /tmp/perf-kit/perf/lib/
    done
    tar cf - -C /tmp/perf-kit perf | xz -T2 -6 > gpu-cpu/perf.tar.xz
    du -sh gpu-cpu
    ;;
cpu-profile)
    # Issue 25's open questions on this host's CPU: whether AMX's bf16 kernel gives exact sums and
    # what it saves, and where a bf16 step's time goes that an f32 step's does not. The kernels'
    # tests, then both dtypes on two cores (CORES), each phase's time, page faults, and perf's flat and
    # inclusive profiles (software clock: these VMs expose no hardware counters), and op_timings with
    # a flat profile of its products; then the planner's test (its cost model against measured
    # peaks on this CPU), and the peer's step by operator. Carry gpu-cpu (`pack-cpu`); results in
    # $OUT, seven text files.
    kit=gpu-cpu
    # After `pack-suite` the kit's binaries are in its archive.
    [ ! -e "$kit/suite-root" ] || unpack_suite
    for f in "${kit_tools[@]/#/$kit/}"; do
        [ -e "$f" ] || xz -dk "$f.xz"
        chmod +x "$f"
    done
    # perf where the kit carries it (`pack-cpu`); without it, no profiles.
    perf=()
    if [ -e "$kit/perf.tar.xz" ]; then
        rm -rf /tmp/perf && tar xJf "$kit/perf.tar.xz" -C /tmp
        perf=(/tmp/perf/lib/ld-linux-x86-64.so.2 --library-path /tmp/perf/lib /tmp/perf/perf)
    fi
    mkdir -p "$out"
    cores=${CORES:-0,1}
    report=$out/cpu-profile.md
    {
        grep -m1 'model name' /proc/cpuinfo
        grep -m1 -E '^cpu family' /proc/cpuinfo
        grep -m1 -E '^model\s' /proc/cpuinfo
        grep -m1 '^flags' /proc/cpuinfo
        echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
        echo "perf_event_paranoid: $(cat /proc/sys/kernel/perf_event_paranoid 2>/dev/null)"
        nproc
    } > "$report" 2>&1
    # The tests first, with the bf16 kernel this CPU chooses in force (AMX's, where it has AMX, has
    # run there only under its own unit tests): every kernel against exact sums, AMX's tiles against
    # a model of them, the kernels' unit tests, the bf16 layers' bits, the kernel choice.
    for test in kernels_lib half_layers bf16_kernel_choice; do
        STREAMBP_FIXTURES=tests/fixtures timeout "$(limit "${LIMIT:-120}")" taskset -c "$cores" \
            "$kit/$test" --nocapture >> "$out/kernels.txt" 2>&1 || echo "$test: exit $?" >> "$out/kernels.txt"
    done
    step_args=(--config benches/configs/qwen3-small.json --seq-lens 2048 --modes stream --chunk 128)
    # dtype, SIMD path, bf16 kernel (`-`: the CPU's own choice).
    for run in "f32 avx512 -" "bf16 avx512 widened" "bf16 avx512 dot" "bf16 avx512 amx" "f32 avx2 -" \
        "bf16 avx2 -"; do
        # shellcheck disable=SC2086
        set -- $run
        echo "== $1, STREAMBP_SIMD=$2, STREAMBP_BF16_KERNEL=$3: phases (JSON)" >> "$report"
        STREAMBP_SIMD=$2 STREAMBP_BF16_KERNEL=$3 timeout "$(limit "${LIMIT:-120}")" taskset -c "$cores" \
            "$kit/streambp-bench" "${step_args[@]}" --dtype "$1" --repeats 3 --op-times \
            --json /tmp/phases.jsonl 2>&1 | grep '^CPU:' >> "$report" || true
        cat /tmp/phases.jsonl >> "$report" 2>/dev/null || true
        rm -f /tmp/phases.jsonl
    done
    for dtype in f32 bf16; do
        [ "${#perf[@]}" -gt 0 ] || break
        echo "== $dtype: perf stat, 4 steps" >> "$report"
        timeout "$(limit "${LIMIT:-120}")" taskset -c "$cores" "${perf[@]}" stat \
            -e task-clock,page-faults,context-switches,cpu-migrations -- "$kit/streambp-bench" \
            "${step_args[@]}" --dtype "$dtype" --repeats 4 >> "$report" 2>&1 || true
        timeout "$(limit "${LIMIT:-120}")" taskset -c "$cores" "${perf[@]}" record -q -e cpu-clock -F 400 \
            --call-graph dwarf,16384 -o "/tmp/perf-$dtype.data" -- "$kit/streambp-bench" \
            "${step_args[@]}" --dtype "$dtype" --repeats 3 > /dev/null 2>&1 || true
        {
            echo "== flat"
            "${perf[@]}" report -i "/tmp/perf-$dtype.data" --no-children --sort dso,sym -g none \
                --percent-limit 0.3 --stdio 2>&1 | grep -v '^#' | grep -v '^$' | head -80 || true
            echo "== inclusive"
            "${perf[@]}" report -i "/tmp/perf-$dtype.data" --children --sort sym -g none \
                --percent-limit 1 --stdio 2>&1 | grep -v '^#' | grep -v '^$' | head -150 || true
        } > "$out/profile-$dtype.txt"
    done
    if [ "${#perf[@]}" -gt 0 ]; then
        RAYON_NUM_THREADS=2 timeout "$(limit "${LIMIT:-120}")" taskset -c "$cores" "${perf[@]}" record \
            -q -e cpu-clock -F 1000 -o /tmp/perf-ops.data -- "$kit/op_timings" > "$out/op_timings.txt" \
            2>&1 || true
        "${perf[@]}" report -i /tmp/perf-ops.data --no-children --sort sym -g none --percent-limit 0.5 \
            --stdio 2>&1 | grep -v '^#' | grep -v '^$' | head -60 >> "$out/op_timings.txt" || true
    else
        RAYON_NUM_THREADS=2 timeout "$(limit "${LIMIT:-120}")" taskset -c "$cores" "$kit/op_timings" \
            > "$out/op_timings.txt" 2>&1 || true
    fi
    # (PLANNER=0 leaves it to `suite`, which runs it among the rest.)
    if [ "${PLANNER:-1}" != 0 ]; then
        timeout "$(limit "${LIMIT:-240}")" taskset -c "$cores" "$kit/planner" --nocapture \
            > "$out/planner.txt" 2>&1 || true
    fi
    # The peer's step by operator (torch's profiler: its products, attention, element-wise work),
    # f32 and bf16 with checkpointing, to set beside the phases' times above (our f32 step at
    # T = 2048 was 1.18x the peer's here on 2026-11-27).
    # (PEER_PROFILE=0 leaves it out.)
    py=$(peer_python)
    for dtype in f32 bf16; do
        [ "${PEER_PROFILE:-1}" != 0 ] || break
        timeout "$(limit "${LIMIT:-120}")" taskset -c "$cores" "$py" scripts/peer_bench.py \
            --config benches/configs/qwen3-small.json --dtype "$dtype" --seqs 2048 --modes gc \
            --repeats 2 --profile >> "$out/peer-profile.txt" 2>&1 || true
    done
    ;;
pack-suite)
    # The workspace's test binaries (`cargo test --release --workspace --no-run` first; `pack-cpu`
    # before this where perf should travel too), for `suite` on a machine without Rust, with the
    # binaries the command-line tests start and those `cpu-profile` runs, in one archive (19 MB for
    # 290 MB) whose single large dictionary finds the code they share. What travels is limited to
    # 64 MiB with the working tree, so the tests are stripped of symbols (the bench and op_timings
    # keep theirs, for perf), those that need a card or MPI are left out, and so are the chat
    # template's and the datasets' (text and files, the same on every CPU); the kit's own copies
    # of what the archive holds are removed. Each line of suite.txt names a test binary, the
    # folder cargo runs it in, and its target's name.
    mkdir -p gpu-cpu
    cargo test --release --workspace --no-run --message-format=json 2>/tmp/pack-suite-build.log \
        | python3 -c '
import json, os, sys
root = os.getcwd()
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(os.path.relpath(m["executable"], root),
              os.path.relpath(os.path.dirname(m["manifest_path"]), root), m["target"]["name"])
' | grep -v -E ' (cuda_parity|distributed|world|chat_template|datasets)$' > gpu-cpu/suite.txt \
        || { echo "pack-suite: the build failed (/tmp/pack-suite-build.log)" >&2; exit 1; }
    pwd > gpu-cpu/suite-root
    rm -rf /tmp/suite-stage
    for f in $(cut -d' ' -f1 gpu-cpu/suite.txt) target/release/streambp-train; do
        mkdir -p "/tmp/suite-stage/$(dirname "$f")"
        strip -o "/tmp/suite-stage/$f" "$f"
    done
    for f in target/release/streambp-bench target/release/examples/op_timings; do
        mkdir -p "/tmp/suite-stage/$(dirname "$f")"
        cp "$f" "/tmp/suite-stage/$f"
    done
    (cd /tmp/suite-stage && tar cf - target) | xz -T1 --lzma2=preset=6,dict=512MiB > gpu-cpu/suite.tar.xz
    rm -rf /tmp/suite-stage
    for f in "${kit_tools[@]}"; do
        rm -f "gpu-cpu/$f.xz"
    done
    du -sh gpu-cpu
    ;;
suite)
    # The whole test suite on this machine's CPU, with its own choices in force (SIMD path, bf16
    # kernel: AMX's where it has AMX), from `pack-suite`'s binaries, each in the folder cargo runs it
    # in, within SESSION_LIMIT seconds in all. One summary line per binary in suite.txt, each
    # binary's output under suite/.
    DEADLINE=${DEADLINE:-$(($(date +%s) + ${SESSION_LIMIT:-450}))}
    export DEADLINE
    unpack_suite
    mkdir -p "$out/suite"
    grep -m1 'model name' /proc/cpuinfo > "$out/suite.txt" || true
    while read -r binary folder name; do
        status=0
        log=$out/suite/$(basename "$folder")-$name.txt
        (cd "$built/$folder" && timeout "$(limit "${LIMIT:-240}")" "$built/$binary") \
            > "$log" 2>&1 < /dev/null || status=$?
        echo "$folder $name: exit $status; $(grep -h '^test result' "$log" | tail -1)" >> "$out/suite.txt"
    done < gpu-cpu/suite.txt
    ;;
host-session)
    # One device call for issue 25's runs on the host CPU alone, the card idle: the whole test suite
    # (`suite`, SUITE_CORES 8-15, the planner's test among it), `cpu-profile` without the planner's
    # test (PROFILE_CORES 2,3) and the peer tables (`cpu`, PEER_CORES 0,1) at once, then, once the
    # other two are done, the peer tables again on a quiet machine (cpu-quiet/; QUIET=0 leaves them
    # out). Carry gpu-cpu (`pack-cpu` for perf, then `pack-suite`). Every run ends by SESSION_LIMIT
    # seconds; $OUT gets results.tgz. Ran whole on an H100 machine's host in 288 s (2026-11-27).
    unpack_suite
    mkdir -p "$out"
    start_session
    export BENCH=gpu-cpu/streambp-bench
    trap bundle EXIT
    taskset -c "${SUITE_CORES:-8-15}" "$0" suite > "$out/suite.log" 2>&1 &
    suite=$!
    PLANNER=0 CORES=${PROFILE_CORES:-2,3} "$0" cpu-profile > "$out/cpu-profile.log" 2>&1 &
    profile=$!
    # (`cpu` writes its bench's output to cpu.log itself; the step's own errors go to cpu-step.log.)
    CORES=${PEER_CORES:-0,1} "$0" cpu > /dev/null 2> "$out/cpu-step.log" || true
    wait "$suite" "$profile" || true
    [ "${QUIET:-1}" != 0 ] || exit 0
    mkdir -p "$out/cpu-quiet"
    OUT=$out/cpu-quiet CORES=${PEER_CORES:-0,1} "$0" cpu > /dev/null 2> "$out/cpu-quiet/cpu-step.log" \
        || true
    ;;
session)
    # One device call for the runs still owed: `parity`, `profile` and `time` at T = 16,384 (stream
    # and checkpoint; since the memory pool keeps its memory, not yet measured on the whole model)
    # on the card (host cores CARD_CORES, 4-15) while the host CPU runs `cpu` (PEER_CORES, 0,1) and
    # `cpu-profile` (PROFILE_CORES, 2,3), carrying `gpu` and `gpu-cpu` (pack both; the CPU side uses
    # the CUDA build's bench, the same host code, and `gpu/streambp-train.xz` and
    # `gpu-cpu/streambp-bench.xz` can be left out: what travels is limited to 64 MiB). The host's figures are taken beside the card's runs (memory bandwidth
    # and caches shared), so they are comparable among themselves, not with a quiet machine's.
    # Every run ends by SESSION_LIMIT seconds; what the steps wrote under $OUT is bundled into
    # results.tgz however the session ends (a call brings back at most 8 files).
    unpack
    mkdir -p gpu-cpu
    [ -e gpu-cpu/streambp-bench ] || cp gpu/streambp-bench gpu-cpu/streambp-bench
    start_session
    trap bundle EXIT
    (
        card_cores=${CARD_CORES:-4-15}
        taskset -c "$card_cores" "$0" parity > "$out/parity.log" 2>&1 || true
        SEQS=4096,16384 taskset -c "$card_cores" "$0" profile > "$out/profile.log" 2>&1 || true
        SEQS=16384 MODES=stream,checkpoint taskset -c "$card_cores" "$0" time > "$out/time.log" 2>&1 \
            || true
    ) &
    CORES=${PEER_CORES:-0,1} "$0" cpu > /dev/null 2> "$out/cpu-step.log" &
    if [ -e gpu-cpu/perf.tar.xz ]; then
        CORES=${PROFILE_CORES:-2,3} "$0" cpu-profile > "$out/cpu-profile.log" 2>&1 &
    fi
    wait
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
