#!/usr/bin/env bash
# Step time of the communication options on a rate-limited multi-host rig (docs/COMMUNICATION.md):
# two hosts as network namespaces (tests/netns.sh: a bridge in a hub namespace, one veth per host,
# Open MPI over TCP on a private subnet that exists inside the namespaces only), 2 ranks on each,
# every host link shaped in both directions with `tc qdisc ... tbf` to RATE (netem is not available
# on these kernels). Ranks on one host talk through the loopback/TCP of their namespace (not shaped),
# ranks on different hosts through the shaped links: communication across "nodes" is what costs.
#
# For each option: `tera bench` (median step time of STEPS steps after a warm-up step), and the bytes
# per rank per step inside and across nodes (its comm line). Nodes are the hosts
# (parallel.ranks_per_node = 0: MPI's shared-memory split by host). ROUNDS rounds, each running every
# option once (interleaved, so that a slow spell of the shared machine hits every option alike); the
# table gives per option the median over the rounds of the runs' median step times.
# Usage: bench/comm_netns.sh [TERA] [RATE] [STEPS] [ROUNDS]   (default build/tera 200mbit 4 1; root
#        needed; writes bench/results/comm_netns.jsonl, one line per run with its round; OPTIONS selects,
#        as in bench/comm.sh)
set -u
TERA=$(readlink -f "${1:-build/tera}")
RATE=${2:-200mbit}
STEPS=${3:-4}
ROUNDS=${4:-1}
cd "$(dirname "$0")/.."
ROOT=$PWD
. tests/netns.sh
command -v mpirun > /dev/null || { echo "mpirun missing" >&2; exit 1; }
command -v tc > /dev/null || { echo "tc (iproute2) missing" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=PASSIVE
W=$(mktemp -d)
trap 'netns_down; rm -rf "$W"' EXIT
NETNS_SLOTS=2
netns_up 2 || { echo "no network namespaces here: $NETNS_WHY" >&2; exit 1; }
# shape both directions of each host link: the host's eth0 (egress from the host) and its hub end
for i in 1 2; do
    ip netns exec "${NETNS_P}h$i" tc qdisc add dev eth0 root tbf rate "$RATE" burst 256kb latency 50ms || exit 1
    ip -n "${NETNS_P}hub" link > /dev/null
    ip netns exec "${NETNS_P}hub" tc qdisc add dev "${NETNS_P}h${i}b" root tbf rate "$RATE" burst 256kb latency 50ms || exit 1
done
head -c 400000 "$ROOT/../shared/data/tinyshakespeare.txt" > "$W/c.txt" 2> /dev/null \
    || python3 -c "import random; random.seed(1); print(' '.join(random.choice(['the','a','king','lord','of','and']) for _ in range(80000)))" > "$W/c.txt"
# a mid-size MoE: 19.9 M parameters (80 MB of fp32 gradients), so a flat step moves tens of MB across
MODEL=(--model.dim=256 --model.n_layers=4 --model.n_heads=8 --model.n_kv_heads=4 --model.n_experts=8 --model.top_k=2
       --model.ffn_dim=512 --model.first_k_dense=1 --training.seq_len=128 --training.micro_batch=2 --training.threads=1
       --training.precision=fp32 --data.path="$W/c.txt" --data.val_fraction=0)
OPTIONS=${OPTIONS:-"flat:4:1: hierarchical:4:1:--parallel.hierarchical=true bf16:4:1:--parallel.grad_compression=bf16
    int8:4:1:--parallel.grad_compression=int8 hier+int8:4:1:--parallel.hierarchical=true,--parallel.grad_compression=int8
    ep4-p2p:4:4: ep4-two-stage:4:4:--parallel.ep_hierarchical=true,--parallel.ep_overlap=0
    ep4-two-stage-overlap:4:4:--parallel.ep_hierarchical=true,--parallel.ep_overlap=1
    ep4-p2p+fp8:4:4:--parallel.a2a_compression=fp8
    ep4-two-stage+fp8:4:4:--parallel.ep_hierarchical=true,--parallel.a2a_compression=fp8,--parallel.ep_overlap=0
    ep4-two-stage-overlap+fp8:4:4:--parallel.ep_hierarchical=true,--parallel.a2a_compression=fp8,--parallel.ep_overlap=1"}
OUT=bench/results/comm_netns.jsonl
mkdir -p bench/results
: > "$W/out.jsonl"
for round in $(seq 1 "$ROUNDS"); do
for o in $OPTIONS; do
    IFS=: read -r name dp ep extra <<< "$o"
    args=(--parallel.dp="$dp" --parallel.ep="$ep")
    [ -n "$extra" ] && IFS=, read -r -a more <<< "$extra" && args+=("${more[@]}")
    netns_hub mpirun --host "$NETNS_HOSTS" --mca plm_rsh_agent "$NETNS_AGENT" $NETNS_MPI_ARGS -np 4 \
        "$TERA" bench "${MODEL[@]}" "${args[@]}" --steps "$STEPS" --warmup 1 > "$W/$name.json" 2> "$W/$name.err" \
        || { echo "$name: failed" >&2; tail -5 "$W/$name.err" >&2; continue; }
    comm=$(sed -n 's/^tera bench: comm //p' "$W/$name.err")
    jq -c --arg name "$name" --arg rate "$RATE" --argjson comm "$comm" --argjson round "$round" \
        '{option: $name, round: $round, rate: $rate, ranks: .ranks, dp, ep, step_ms_median, tokens_per_s,
          intra_bytes_per_rank_step: $comm.intra_bytes_per_rank_step, inter_bytes_per_rank_step: $comm.inter_bytes_per_rank_step,
          comm_nodes: $comm.comm_nodes}' "$W/$name.json" | tee -a "$W/out.jsonl"
done
done
cp "$W/out.jsonl" "$OUT"
echo "wrote $OUT"
# per option (in the order run): the median over the rounds of the step time, every round's, the speed-up
# against flat (expert-parallel rows: against ep4-p2p), the bytes
echo "| option | step (ms), median of $ROUNDS | rounds (ms) | speed-up | bytes across nodes per rank per step | inside |"
echo "|---|---|---|---|---|---|"
jq -r -s 'def med: sort | if length % 2 == 1 then .[length / 2 | floor] else (.[length / 2 - 1] + .[length / 2]) / 2 end;
    (map(.option) | reduce .[] as $o ([]; if index([$o]) then . else . + [$o] end)) as $names |
    (map(select(.option == "flat") | .step_ms_median) | if length > 0 then med else null end) as $flat |
    (map(select(.option == "ep4-p2p") | .step_ms_median) | if length > 0 then med else null end) as $p2p |
    $names[] as $n | map(select(.option == $n)) as $r | ($r | map(.step_ms_median) | med) as $m |
    "| \($n) | \($m | round) | \($r | map(.step_ms_median | round | tostring) | join(", ")) | " +
    (if $r[0].ep == 1 and $flat then "\(($flat / $m * 100 | round) / 100)x" elif $p2p then "\(($p2p / $m * 100 | round) / 100)x of ep4-p2p" else "" end) +
    " | \($r[0].inter_bytes_per_rank_step) | \($r[0].intra_bytes_per_rank_step) |"' "$OUT"
