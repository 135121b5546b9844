# Shared by the MPI tests (sourced once TERA and SRC are set): Open MPI allowed as root and
# oversubscribed, leak checking off for Open MPI's own allocations (its plugins are unloaded at
# finalize, so their frames cannot be suppressed by name; ASan's memory-error checks stay on), a
# clean skip when mpirun is absent, testlib.sh, the corpus slice $W/c.txt, and MODEL: a tiny MoE
# with every tensor kind (GQA 8/4 heads, a dense first layer, a shared expert, capacity with drops,
# z-loss, aux-loss-free bias) whose widths every tested layout divides (tp 4, ep 4, pp 4), in fp32.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
MPIRUN="mpirun --oversubscribe"
command -v mpirun > /dev/null || { echo "skip: mpirun not installed"; exit 0; }
. "$(dirname "${BASH_SOURCE[0]}")/testlib.sh"
head -c 60000 "$SRC/data/default_corpus.txt" > "$W/c.txt"
MODEL=(--model.dim=32 --model.n_layers=4 --model.n_heads=8 --model.n_kv_heads=4 --model.n_experts=4 --model.ffn_dim=32
       --model.capacity_factor=1.25 --model.z_coef=0.001 --model.aux_free=true --model.n_shared_experts=1
       --model.first_k_dense=1 --training.seq_len=32 --training.warmup_steps=2 --training.threads=1
       --data.path="$W/c.txt" --data.val_fraction=0.1 --training.precision=fp32)
# relative tolerance of a layout against one rank in fp32 (derived in tests/cli_layouts.sh)
LAYOUT_TOL=2e-6
# refused KEY N [ARGS...]: `tera train` with ARGS on N ranks (1: without mpirun) exits non-zero with a
# message naming KEY, before any step (no metrics in $W/bad); the output in $W/bad.log
refused() {
    local key=$1 n=$2 rc
    shift 2
    rm -rf "$W/bad"
    if [ "$n" = 1 ]; then
        "$TERA" train "$@" --logging.run_dir="$W/bad" > "$W/bad.log" 2>&1
    else
        $MPIRUN -np "$n" "$TERA" train "$@" --logging.run_dir="$W/bad" > "$W/bad.log" 2>&1
    fi
    rc=$?
    [ "$rc" != 0 ] && grep -q "$key" "$W/bad.log" && [ ! -e "$W/bad/metrics.jsonl" ]
}
