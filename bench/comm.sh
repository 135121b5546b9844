#!/usr/bin/env bash
# Communication options (docs/COMMUNICATION.md): bytes per rank per step inside and across nodes
# for each option on configs/bench-dist.ini, and the convergence of a short run per option against
# fp32 flat sums.
#
# Bytes: 4 ranks as 2 emulated nodes of 2 (parallel.ranks_per_node = 2), dp 4 (and dp 4 x ep 2 for
# the expert exchange), global batch 16 sequences; `tera bench` reports rank 0's bytes by kind and
# (its "comm" line on stderr) the mean over the ranks inside and across nodes and the most any rank
# sends across. The byte counts are exact whatever the machine's load (they count what each
# collective sends); the step times are not meaningful on a shared machine and are not reported.
# Convergence: the tiny MoE of tests/mpilib.sh (fp32), STEPS steps on 4 ranks per option, the
# final validation loss (tera eval of the last checkpoint) against fp32 flat.
# Usage: bench/comm.sh [TERA] [STEPS]   (writes bench/results/comm.jsonl and comm-converge.jsonl;
#        PARTS="bytes converge" selects)
set -eu
TERA=${1:-build/tera}
STEPS=${2:-200}
PARTS=${PARTS:-"bytes converge"}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=PASSIVE
cd "$(dirname "$0")/.."
mkdir -p bench/results
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

# name : ep : zero : extra options (comma-separated)
OPTIONS=${OPTIONS:-"fp32-flat:1:0: hierarchical:1:0:--parallel.hierarchical=true
    bf16:1:0:--parallel.grad_compression=bf16 fp16:1:0:--parallel.grad_compression=fp16
    int8:1:0:--parallel.grad_compression=int8
    hier+int8:1:0:--parallel.hierarchical=true,--parallel.grad_compression=int8
    zero1-flat:1:1: zero1-hier:1:1:--parallel.hierarchical=true zero1-bf16:1:1:--parallel.grad_compression=bf16
    ep2-flat:2:0: ep2-a2a-bf16:2:0:--parallel.a2a_compression=bf16 ep2-a2a-fp8:2:0:--parallel.a2a_compression=fp8
    onebit:1:0:--optimizer.name=onebit_adam,--optimizer.onebit_warmup_steps=OBW
    zero1-onebit:1:1:--optimizer.name=onebit_adam,--optimizer.onebit_warmup_steps=OBW
    ep2-onebit:2:0:--optimizer.name=onebit_adam,--optimizer.onebit_warmup_steps=OBW"}
# 1-bit Adam's warm-up (OBW above): one step for the bytes (the measured step is after it), a fifth of
# the run for the convergence

if [[ " $PARTS " == *" bytes "* ]]; then
    OUT=bench/results/comm.jsonl
    : > "$OUT"
    for o in $OPTIONS; do
        IFS=: read -r name ep zero extra <<< "$o"
        extra=${extra//OBW/1}
        IFS=, read -r -a ex <<< "$extra"
        mpirun --oversubscribe -np 4 "$TERA" bench -c configs/bench-dist.ini --name "bench-dist/$name" --steps 1 \
            --warmup 1 --training.micro_batch=4 --parallel.dp=4 --parallel.ep="$ep" --parallel.zero="$zero" \
            --parallel.ranks_per_node=2 --training.threads=1 "${ex[@]}" > "$W/b.json" 2> "$W/b.err"
        sed -n 's/^tera bench: comm //p' "$W/b.err" > "$W/c.json"
        jq -c -s --arg n "$name" '.[0] + .[1] + {option: $n} | {option, ep, zero, comm_nodes, intra_bytes_per_rank_step,
            inter_bytes_per_rank_step, inter_bytes_max_rank_step, bytes_sent_per_step, sent_allreduce,
            sent_reduce_scatter, sent_allgather, sent_p2p, grad_min_bytes, stats_bytes}' "$W/b.json" "$W/c.json" | tee -a "$OUT"
    done
    echo "| option | bytes/rank/step inside nodes | across nodes (mean) | across (busiest rank) | all bytes vs fp32 flat |"
    echo "|---|---|---|---|---|"
    # the reference of a row: the fp32 flat run of the same layout (same ep and zero)
    jq -r -s '. as $all | .[] | . as $o |
        ($all | map(select(.ep == $o.ep and .zero == $o.zero and (.option | test("flat$"))))[0]) as $r |
        "| \(.option) | \(.intra_bytes_per_rank_step) | \(.inter_bytes_per_rank_step) | \(.inter_bytes_max_rank_step) | " +
        "\((((.intra_bytes_per_rank_step + .inter_bytes_per_rank_step) / ($r.intra_bytes_per_rank_step + $r.inter_bytes_per_rank_step)) * 1000 | round) / 1000) |"' "$OUT"
fi

if [[ " $PARTS " == *" converge "* ]]; then
    OUT=bench/results/comm-converge.jsonl
    : > "$OUT"
    head -c 60000 data/default_corpus.txt > "$W/c.txt"
    MODEL=(--model.dim=32 --model.n_layers=4 --model.n_heads=8 --model.n_kv_heads=4 --model.n_experts=4
           --model.ffn_dim=32 --model.capacity_factor=1.25 --model.z_coef=0.001 --model.aux_free=true
           --model.n_shared_experts=1 --model.first_k_dense=1 --training.seq_len=32 --training.warmup_steps=10
           --training.threads=1 --data.path="$W/c.txt" --data.val_fraction=0.1 --training.precision=fp32)
    for o in $OPTIONS; do
        IFS=: read -r name ep zero extra <<< "$o"
        extra=${extra//OBW/$((STEPS / 5))}
        IFS=, read -r -a ex <<< "$extra"
        mpirun --oversubscribe -np 4 "$TERA" train "${MODEL[@]}" --training.steps="$STEPS" --training.micro_batch=2 \
            --parallel.dp=4 --parallel.ep="$ep" --parallel.zero="$zero" --parallel.ranks_per_node=2 "${ex[@]}" \
            --logging.progress=false --logging.run_dir="$W/$name" > "$W/$name.log" 2>&1
        ck=$(printf '%s/checkpoints/step_%08d' "$W/$name" "$STEPS")
        v=$("$TERA" eval --from "$ck" --data.path="$W/c.txt" --data.val_fraction=0.1 --training.seq_len=32 \
            --training.micro_batch=4 --training.eval_batches=8 2> /dev/null | jq -r '.val_loss')
        jq -n -c --arg n "$name" --argjson v "$v" --argjson s "$STEPS" '{option: $n, steps: $s, val_loss: $v}' | tee -a "$OUT"
    done
    echo "| option | final validation loss | vs fp32 flat |"
    echo "|---|---|---|"
    jq -r -s '(map(select(.option == "fp32-flat"))[0].val_loss) as $f | (map(select(.option == "ep2-flat"))[0].val_loss) as $e |
        .[] | (if (.option | startswith("ep2")) then $e else $f end) as $r |
        "| \(.option) | \(.val_loss) | \(((.val_loss - $r) / $r * 10000 | round) / 100)% |"' "$OUT"
fi
