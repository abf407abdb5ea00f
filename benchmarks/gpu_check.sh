#!/usr/bin/env bash
# The GPU check (issue 38): one prepared script for a lent H100/H200, under 10 minutes of device time.
#
#   bash benchmarks/gpu_check.sh        (from anywhere; logs and results go to $OUT, else /tmp/gpu-check-out)
#
# Stages, each under its own timeout and all under one overall budget (GPU_CHECK_BUDGET_S, default 560 s), a
# failed stage logged and passed over: the compiled CUDA tests; offline throughput at 1/64/256 streams for random
# models of SmolLM2-135M's and Llama-3-8B's shapes against HF generate and the HBM roofline; then the same
# SmolLM2-shaped model served over HTTP by `pagedserve serve`; the Triton attention kernels against the torch
# backend (benchmarks/bench_attention.py); then one table. Without CUDA the tiny shape runs on the CPU instead, and
# the CUDA-only stages say they were skipped.
#
# Missing packages travel as wheels in .whl/ (installed to /tmp/site), SmolLM2's config and tokenizer as a
# pagedserve home in .whl/pagedserve-home (its weights stay behind: every model here has random weights); make
# them here with `python -m benchmarks.gpu_wheels`, then `run` this script with `carry: [".whl"]`.
set -u

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 1
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
BUDGET_S=${GPU_CHECK_BUDGET_S:-560}
PYTHON=${PYTHON:-python3}
STREAMS=${GPU_CHECK_STREAMS:-1,64,256}
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
SUMMARY=$OUT/summary.log
export PYTHONUNBUFFERED=1
# The report needs this many seconds at the end.
REPORT_RESERVE_S=15

log() {
    echo "[gpu_check +${SECONDS}s] $*" | tee -a "$SUMMARY"
}

# stage NAME CAP_S COMMAND...: runs COMMAND under min(CAP_S, what the budget has left), output to $OUT/NAME.log.
stage() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET_S - SECONDS - REPORT_RESERVE_S))
    local limit=$((cap < left ? cap : left))
    if ((limit < 30)); then
        log "stage $name: skipped: ${left}s of the ${BUDGET_S}s budget left"
        return 0
    fi
    log "stage $name (limit ${limit}s): $*"
    local started=$SECONDS
    timeout -k 15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    if ((rc == 0)); then
        log "stage $name: ok in $((SECONDS - started))s"
    else
        log "stage $name: FAILED (rc $rc$( ((rc == 124 || rc == 137)) && echo ', timed out')) in $((SECONDS - started))s; its last lines:"
        tail -n 25 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
    fi
    return 0
}

log "repo $REPO, out $OUT, work $WORK, budget ${BUDGET_S}s"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || echo "no nvidia-smi"
    df -h /tmp
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl && echo "installed $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site" ||
            echo "carried wheels NOT installed: pip failed (see above)"
        export PYTHONPATH=/tmp/site:$REPO
    else
        export PYTHONPATH=$REPO
    fi
    if [ -d .whl/pagedserve-home ]; then
        cp -r .whl/pagedserve-home "$WORK/pagedserve-home"
        export PAGEDSERVE_HOME=$WORK/pagedserve-home
    fi
    "$PYTHON" - <<'EOF'
import importlib
import torch
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())
for name in ("triton", "transformers", "numpy", "pydantic", "ray", "starlette", "fastapi"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:
        print(name, "missing:", error)
EOF
} >"$OUT/setup.log" 2>&1
# The exports above ran in a group of this shell, not a subshell: they hold for every stage.
grep -E "installed|^python|missing|^ray|^NVIDIA|^name" "$OUT/setup.log" | sed 's/^/    /' | tee -a "$SUMMARY"

if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    DEVICE=cuda
else
    DEVICE=cpu
fi
log "device: $DEVICE"

if [ "$DEVICE" = cuda ]; then
    # Compiled kernels only: the image's NumPy breaks Triton's interpreter, and conftest interprets only without CUDA.
    # The interpreter child test needs a NumPy the image lacks (see the comment above): deselected, not failed.
    # Triton attention last: its compiled-kernel cases spend ~100 s on first builds, and a cap should cut only those.
    stage tests 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda_engine.py tests/test_cuda_graphs.py \
        tests/test_triton_fused_ops.py tests/test_heap_reuse.py tests/test_lora_ops.py tests/test_triton_attention.py \
        --deselect tests/test_triton_attention.py::test_interpreter_tests_in_subprocess
    grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 1 | sed 's/^/    /' | tee -a "$SUMMARY"
    stage offline-smollm2 100 "$PYTHON" -m benchmarks.gpu_bench offline --shape smollm2 --device cuda \
        --streams "$STREAMS" --hf-max-time-s 8 --work-dir "$WORK" --json-out "$WORK/offline-smollm2.json"
    stage offline-llama3-8b 230 "$PYTHON" -m benchmarks.gpu_bench offline --shape llama3-8b --device cuda \
        --streams "$STREAMS" --hf-max-time-s 10 --work-dir "$WORK" --json-out "$WORK/offline-llama3-8b.json"
    # Last: a server that outlives a timed-out stage holds the GPU only until the machine goes back.
    stage http-smollm2 120 "$PYTHON" -m benchmarks.gpu_bench http --shape smollm2 --device cuda \
        --streams "$STREAMS" --work-dir "$WORK" --server-log "$WORK/server.log" --json-out "$WORK/http-smollm2.json"
    if [ -f "$WORK/server.log" ]; then
        echo "---- server log ----" >>"$OUT/http-smollm2.log"
        cat "$WORK/server.log" >>"$OUT/http-smollm2.log"
    fi
    # The Triton attention kernels against the torch backend per layer step: a benchmark, not a timed test.
    stage attention 60 "$PYTHON" -m benchmarks.bench_attention --dtype bfloat16
    grep -E "metadata|x ctx|prefill|mixed" "$OUT/attention.log" | sed 's/^/    /' | tee -a "$SUMMARY"
else
    log "stage tests: skipped: no CUDA on this machine (the CUDA tests need a GPU)"
    log "stage offline-smollm2, http-smollm2, offline-llama3-8b: skipped: no CUDA on this machine"
    stage offline-tiny-cpu 120 "$PYTHON" -m benchmarks.gpu_bench offline --shape tiny --device cpu --streams 1,4 \
        --input-len 16 --output-len 8 --work-dir "$WORK" --json-out "$WORK/offline-tiny-cpu.json"
fi

log "report"
"$PYTHON" -m benchmarks.gpu_bench report "$WORK"/*.json --json-out "$OUT/results.json" --table-out "$OUT/table.md" \
    >>"$SUMMARY" 2>&1
echo
cat "$OUT/table.md" 2>/dev/null || echo "no table: see $SUMMARY"
rm -rf "$WORK"
log "done in ${SECONDS}s"
