# Sourced by the run_*.sh wrappers: `launch SCRIPT ARGS...` runs a training script under torchrun
# (through launch.py, which keeps bad input to one line and exit 2) on the machine it finds.
# Environment (all optional):
#   NPROC        processes on this node (default: the GPUs visible, per CUDA_VISIBLE_DEVICES or
#                nvidia-smi; 1 without a GPU)
#   NNODES       nodes in the job (default 1); NODE_RANK this node's rank (default 0)
#   MASTER_ADDR  the rank-0 node's address (default 127.0.0.1); MASTER_PORT its port (default 29500)
#   PYTHON       the interpreter with torch installed (default: python3)
#   DRY_RUN=1    print the command instead of running it

visible_gpus() {
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
        # An empty or "-1" list hides every GPU.
        local devices="${CUDA_VISIBLE_DEVICES//[[:space:]]/}"
        if [ -z "$devices" ] || [ "$devices" = "-1" ]; then echo 0; else echo "$devices" | tr ',' '\n' | grep -c .; fi
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

launch() {
    local gpus
    gpus="$(visible_gpus)"
    local nproc="${NPROC:-$(( gpus > 0 ? gpus : 1 ))}"
    local launcher="$(dirname "${BASH_SOURCE[0]}")/launch.py"
    local command=("${PYTHON:-python3}" "$launcher" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "$nproc"
                   --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" "$@")
    if [ "${DRY_RUN:-0}" = "1" ]; then
        printf '%q ' "${command[@]}"
        echo
        return 0
    fi
    exec "${command[@]}"
}
