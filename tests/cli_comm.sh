#!/usr/bin/env bash
# Communication at cluster scale, end to end (docs/COMMUNICATION.md): the tiny MoE of mpilib.sh
# trains 8 steps in fp32 on 4 ranks (2 emulated nodes of 2: parallel.ranks_per_node = 2) with each
# option, against the flat fp32 run of the same layout:
# - parallel.hierarchical = true reorders only the fp32 sums (node sums first): every step's loss
#   and grad norm within LAYOUT_TOL of flat, with ZeRO 0-3 and with expert parallelism;
#   on one node (ranks_per_node = 0: this machine's one host) it is a no-op: bit-identical metrics;
# - parallel.grad_compression = bf16 | fp16 | int8 (error feedback) and parallel.a2a_compression =
#   bf16 | fp8 change the numbers (not bit-identical to flat) but train alike: the final loss within
#   1% of flat (int8: 2%), with ZeRO 1 and 2, expert parallelism and hierarchical sums;
# - bytes (tera bench, rank-mean per step): hierarchical sends fewer bytes across nodes than flat,
#   bf16 at most half of fp32's gradient bytes, int8 about a quarter (+ its scales);
# - parallel.ep_hierarchical = true (the two-stage expert exchange across nodes) is bit-identical
#   to the point-to-point exchange, fp32 and bf16 rows, overlapped with the experts or not
#   (parallel.ep_overlap), with the same bytes inside and across nodes either way;
# - under bf16 products the rows to the experts go as bf16 without a2a_compression: bit-identical to
#   fp32 rows, 3/4 of the exchange's bytes;
# - a bad value is refused naming the key.
# Usage: cli_comm.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
TOL=$LAYOUT_TOL
TINY=("${MODEL[@]}" --training.steps=8 --training.micro_batch=1 --training.grad_accum=1 --logging.progress=false)

last_loss() { steps_of "$1/metrics.jsonl" | tail -1 | cut -d' ' -f2; }
# run NAME NP ARGS...: trains into $W/NAME
run() {
    local name=$1 np=$2
    shift 2
    $MPIRUN -np "$np" "$TERA" train "${TINY[@]}" "$@" --logging.run_dir="$W/$name" > "$W/$name.log" 2>&1 \
        || { fail "$name: run failed"; tail -5 "$W/$name.log"; return 1; }
}
# close NAME REF TOL: final losses within TOL relative, and not bit-identical (the option acts)
close() {
    local a b
    a=$(last_loss "$W/$2"); b=$(last_loss "$W/$1")
    if cmp -s <(steps_of "$W/$2/metrics.jsonl") <(steps_of "$W/$1/metrics.jsonl"); then
        fail "$1: bit-identical to $2 (the option did nothing)"
    elif within "$a" "$b" "$3"; then
        pass "$1: final loss $b vs $a ($2), within $3"
    else
        fail "$1: final loss $b vs $a ($2), not within $3"
    fi
}

N2=(--parallel.dp=4 --parallel.ranks_per_node=2)
for z in 0 1 2 3; do
    run flat-z$z 4 "${N2[@]}" --parallel.zero=$z || continue
    run hier-z$z 4 "${N2[@]}" --parallel.zero=$z --parallel.hierarchical=true || continue
    out=$(compare_steps "$W/flat-z$z/metrics.jsonl" "$W/hier-z$z/metrics.jsonl" "$TOL") \
        && pass "hierarchical zero$z: every step within $TOL of flat ($out)" || fail "hierarchical zero$z: $out"
done
C=checkpoints/step_00000008/model.safetensors
run hier-1node 4 --parallel.dp=4 --parallel.hierarchical=true \
    && cmp -s <(steps_of "$W/flat-z0/metrics.jsonl") <(steps_of "$W/hier-1node/metrics.jsonl") \
    && cmp -s "$W/flat-z0/$C" "$W/hier-1node/$C" \
    && pass "hierarchical on one node: bit-identical to flat (every step, final weights)" \
    || fail "hierarchical on one node differs from flat"
EP=(--parallel.dp=4 --parallel.ep=2 --parallel.zero=1 --parallel.ranks_per_node=2)
run flat-ep 4 "${EP[@]}" && run hier-ep 4 "${EP[@]}" --parallel.hierarchical=true && {
    out=$(compare_steps "$W/flat-ep/metrics.jsonl" "$W/hier-ep/metrics.jsonl" "$TOL") \
        && pass "hierarchical dp4 x ep2 zero1: within $TOL of flat ($out)" || fail "hierarchical ep2: $out"
}

for kz in bf16:0 bf16:1 bf16:2 fp16:0 int8:0 int8:2; do
    k=${kz%:*} z=${kz#*:} tol=0.01
    [ $k = int8 ] && tol=0.02
    run $k-z$z 4 "${N2[@]}" --parallel.zero=$z --parallel.grad_compression=$k && close $k-z$z flat-z$z $tol
done
run int8-hier 4 "${N2[@]}" --parallel.grad_compression=int8 --parallel.hierarchical=true && close int8-hier flat-z0 0.02
run bf16-ep 4 "${EP[@]}" --parallel.grad_compression=bf16 && close bf16-ep flat-ep 0.01
for k in bf16 fp8; do
    run a2a-$k 4 "${EP[@]}" --parallel.a2a_compression=$k && close a2a-$k flat-ep 0.01
done
# the two-stage expert exchange (parallel.ep_hierarchical): ep = 4 over 2 nodes of 2, against the
# point-to-point exchange: bit-identical steps and final weights, fp32 and with bf16 rows, both
# overlapped with the experts' compute (parallel.ep_overlap = 1, the default: the split-phase
# exchange) and not (0: one blocking exchange, then the experts)
EP4=(--parallel.dp=4 --parallel.ep=4 --parallel.ranks_per_node=2)
for k in none bf16; do
    run p2p-ep4-$k 4 "${EP4[@]}" --parallel.a2a_compression=$k || continue
    for ov in 1 0; do
        run hier-ep4-$k-ov$ov 4 "${EP4[@]}" --parallel.a2a_compression=$k --parallel.ep_hierarchical=true \
            --parallel.ep_overlap=$ov \
            && cmp -s <(steps_of "$W/p2p-ep4-$k/metrics.jsonl") <(steps_of "$W/hier-ep4-$k-ov$ov/metrics.jsonl") \
            && cmp -s "$W/p2p-ep4-$k/$C" "$W/hier-ep4-$k-ov$ov/$C" \
            && pass "two-stage expert exchange (ep4 on 2 nodes, rows $k, ep_overlap $ov): bit-identical to point-to-point ($(steps_of "$W/p2p-ep4-$k/metrics.jsonl" | wc -l) steps, final weights)" \
            || fail "two-stage expert exchange (rows $k, ep_overlap $ov) differs from point-to-point"
    done
done

# bf16 products: the rows to the experts travel as bf16 (the products round them to bf16 anyway), the
# results as fp32: bit-identical to fp32 rows (TERA_A2A_ROWS_BF16=0), point-to-point and two-stage
# across the 2 nodes, with 3/4 of the exchange's bytes (2 + 4 bytes an element out and back, not 4 + 4)
BF=(--training.precision=bf16 --training.bf16_gemm=native)
for ex in p2p hier; do
    X=(); [ $ex = hier ] && X=(--parallel.ep_hierarchical=true)
    TERA_A2A_ROWS_BF16=0 run rows32-$ex 4 "${EP4[@]}" "${BF[@]}" "${X[@]}" && run rows16-$ex 4 "${EP4[@]}" "${BF[@]}" "${X[@]}" \
        && cmp -s <(steps_of "$W/rows32-$ex/metrics.jsonl") <(steps_of "$W/rows16-$ex/metrics.jsonl") \
        && cmp -s "$W/rows32-$ex/$C" "$W/rows16-$ex/$C" \
        && pass "bf16 products, ep4 ($ex exchange): bf16 rows out bit-identical to fp32 rows ($(steps_of "$W/rows16-$ex/metrics.jsonl" | wc -l) steps, final weights)" \
        || fail "bf16 products, ep4 ($ex exchange): bf16 rows out differ from fp32 rows"
done
# bytes per rank per step (tera bench's comm line, the mean over ranks)
bench() { # NAME ARGS...
    local name=$1
    shift
    $MPIRUN -np 4 "$TERA" bench "${MODEL[@]}" --training.micro_batch=1 --steps 2 --warmup 1 --parallel.dp=4 \
        --parallel.ranks_per_node=2 "$@" > "$W/b-$name.json" 2> "$W/b-$name.err" || { fail "bench $name"; tail -3 "$W/b-$name.err"; }
    sed -n 's/^tera bench: comm //p' "$W/b-$name.err" > "$W/b-$name.comm"
}
bench flat && bench hier --parallel.hierarchical=true && bench bf16 --parallel.grad_compression=bf16 \
    && bench int8 --parallel.grad_compression=int8
b() { jq -r ".$2" "$W/b-$1.comm"; }
# bf16 rows out (above): 3/4 of the exchange's bytes, each run the minimum tera bench computes
EB=(--parallel.ep=4 --training.precision=bf16 --training.bf16_gemm=native --model.router_force_balance=true)
TERA_A2A_ROWS_BF16=0 bench rows32 "${EB[@]}" && bench rows16 "${EB[@]}" \
    && jq -e '.sent_p2p == .min_p2p' "$W/b-rows16.json" > /dev/null && jq -e '.sent_p2p == .min_p2p' "$W/b-rows32.json" > /dev/null \
    && [ "$(( $(jq -r .sent_p2p "$W/b-rows32.json") * 3 ))" = "$(( $(jq -r .sent_p2p "$W/b-rows16.json") * 4 ))" ] \
    && pass "bf16 rows out: $(jq -r .sent_p2p "$W/b-rows16.json") exchange bytes a step against $(jq -r .sent_p2p "$W/b-rows32.json") (3/4), each the minimum tera bench computes" \
    || fail "bf16 rows out bytes: $(jq -c '[.sent_p2p, .min_p2p]' "$W/b-rows16.json") against $(jq -c '[.sent_p2p, .min_p2p]' "$W/b-rows32.json")"
# the two-stage expert exchange (not overlapped: blocking all-to-alls): no point-to-point rows, the
# same bytes across nodes (relayed inside); overlapped (split-phase: its stages are point-to-point
# messages) the same bytes inside and across nodes as not overlapped
bench p2p-ep4 --parallel.ep=4 && bench hier-ep4 --parallel.ep=4 --parallel.ep_hierarchical=true --parallel.ep_overlap=0 \
    && [ "$(jq -r .sent_p2p "$W/b-hier-ep4.json")" = 0 ] && [ "$(jq -r .sent_p2p "$W/b-p2p-ep4.json")" != 0 ] \
    && [ "$(b hier-ep4 inter_bytes_per_rank_step)" = "$(b p2p-ep4 inter_bytes_per_rank_step)" ] \
    && [ "$(b hier-ep4 ep_hierarchical)" = 1 ] \
    && pass "two-stage expert exchange: all rows through it, $(b hier-ep4 inter_bytes_per_rank_step) bytes across nodes per rank per step as point-to-point, $(b hier-ep4 intra_bytes_per_rank_step) inside (point-to-point $(b p2p-ep4 intra_bytes_per_rank_step))" \
    || fail "two-stage expert exchange bytes: $(cat "$W/b-hier-ep4.comm") vs $(cat "$W/b-p2p-ep4.comm")"
bench hier-ep4-ov --parallel.ep=4 --parallel.ep_hierarchical=true --parallel.ep_overlap=1 \
    && [ "$(b hier-ep4-ov inter_bytes_per_rank_step)" = "$(b hier-ep4 inter_bytes_per_rank_step)" ] \
    && [ "$(b hier-ep4-ov intra_bytes_per_rank_step)" = "$(b hier-ep4 intra_bytes_per_rank_step)" ] \
    && [ "$(jq -r .sent_p2p "$W/b-hier-ep4-ov.json")" != 0 ] \
    && pass "two-stage expert exchange overlapped: the same $(b hier-ep4-ov inter_bytes_per_rank_step) bytes across nodes and $(b hier-ep4-ov intra_bytes_per_rank_step) inside" \
    || fail "overlapped two-stage expert exchange bytes: $(cat "$W/b-hier-ep4-ov.comm") vs $(cat "$W/b-hier-ep4.comm")"
# rank 0's gradient all-reduce bytes: its all-reduce bytes less the statistics' (flat's all-reduce
# bytes above its gradients' minimum; those sums are not compressed)
other=$(jq -r '.sent_allreduce - .grad_min_bytes' "$W/b-flat.json")
g() { jq -r ".sent_allreduce - $other" "$W/b-$1.json"; }
awk -v f="$(b flat inter_bytes_per_rank_step)" -v h="$(b hier inter_bytes_per_rank_step)" \
    'BEGIN { exit !(h > 0 && h < f) }' \
    && pass "bytes across nodes per rank per step: hierarchical $(b hier inter_bytes_per_rank_step) < flat $(b flat inter_bytes_per_rank_step)" \
    || fail "hierarchical does not cut bytes across nodes: $(b hier inter_bytes_per_rank_step) vs $(b flat inter_bytes_per_rank_step)"
# bf16: exactly half; int8: a quarter + one 4-byte scale per 256 values of each chunk (x 1.016 + rounding)
awk -v f="$(g flat)" -v h="$(g bf16)" -v i="$(g int8)" 'BEGIN { exit !(h <= 0.5 * f && i <= 0.255 * f) }' \
    && pass "gradient all-reduce bytes per step: fp32 $(g flat), bf16 $(g bf16), int8 $(g int8) ($(awk -v f="$(g flat)" \
       -v h="$(g bf16)" -v i="$(g int8)" 'BEGIN { printf "%.4f and %.4f of fp32", h / f, i / f }'))" \
    || fail "compressed gradient bytes: fp32 $(g flat), bf16 $(g bf16), int8 $(g int8)"

# bad values
out=$("$TERA" train "${TINY[@]}" --parallel.grad_compression=fp4 --logging.run_dir="$W/bad" 2>&1) \
    && fail "grad_compression=fp4 accepted" || { echo "$out" | grep -q "grad_compression" \
    && pass "a bad compression is refused naming the key" || fail "bad compression message: $out"; }
out=$($MPIRUN -np 4 "$TERA" train "${TINY[@]}" --parallel.dp=4 --parallel.ranks_per_node=3 --logging.run_dir="$W/bad2" 2>&1) \
    && fail "ranks_per_node=3 on 4 ranks accepted" || { echo "$out" | grep -q "ranks_per_node" \
    && pass "ranks_per_node not dividing the ranks is refused naming the key" || fail "ranks_per_node message: $out"; }
finish cli_comm
