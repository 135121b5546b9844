#!/usr/bin/env bash
# The communication volume of the parallel layouts equals the analytic minimum of `tera bench`
# (src/cli/cmd_bench.c, docs/PERFORMANCE.md "bench-dist"), so a change in what a layout sends
# fails here. A tiny MoE (a dense first layer, a shared expert, 2 MoE layers) runs 2 timed steps
# of `tera bench` under mpirun as dp2, tp2, ep2, dp2 with ZeRO-3, ZeRO-2 and ZeRO-1, pp2, tp2 x pp2, and pp2 x dp2
# with ZeRO-3 (4 micro-batches: its gathers follow the 1F1B order), and tp2 with parallel.tp_overlap=0,
# in bf16 (the default 1: no overlap there) and in bf16 with parallel.tp_overlap=2 (2 micro-batches a step where it matters; rank 0's bytes: with a pipeline, the first stage's),
# pp2 and pp2 x dp2 ZeRO-1 with the head split between the stages (parallel.pp_head_split), pp2 with the
# split and the head's weight gradients deferred (parallel.pp_defer_wgrad: the same bytes), and
# for each JSON line:
#   - every kind of transfer whose volume does not depend on the data (all-reduce, reduce-scatter,
#     all-gather, all-to-all) sent exactly its minimum plus its known overhead (statistics
#     all-reduces, expert row counts): tolerance 1 byte per step;
#   - parallel.tp_overlap (on by default) waits for each backward sum of an input gradient after the
#     weight gradients it overlapped: tp_overlapped_per_step is per micro-batch 2 per dense layer (the
#     FFN, q/k/v), 3 per MoE layer (and the combine weights) and 1 for the head (tp2: 2 + 2 x 3 + 1 = 9;
#     with a pipeline, rank 0's stage: some), and 0 with tp = 1, the overlap off, or bf16 products
#     under the default 1 (2: in every precision); the bytes are the same (the checks above), and
#     the numbers too (tests/cli_layouts.sh);
#   - ZeRO-1/2/3 start every gradient reduce-scatter non-blocking (zero_rs_overlapped_per_step equals
#     zero_rs_per_step, and that is positive; ZeRO-1: one per bucket of the last micro-batch's
#     backward; 0 without ZeRO), except with TERA_ZERO_RS_OVERLAP=0 (the -rsoff layouts: blocking,
#     none overlapped (ZeRO-1: none counted), the same bytes above and the same final loss as the overlapped dp2-zero3 /
#     dp2-zero1; tests/test_zero.c checks the weights bit for bit);
#   - ZeRO-3 gathers every layer's parameters in host-shared memory (zero3_shared_gathers_per_step equals
#     zero3_gathers_per_step, positive), none with TERA_ZERO_SHARED=0 (dp2-zero3-noshared: the same
#     bytes and final loss as dp2-zero3); the data-parallel layouts sum their gradients there
#     (zero_shared_sums_per_step positive; ZeRO-1 with its reduce-scatters overlapped; dp4xep2-zero1 with
#     the experts over part of the ranks, edp 2 of dp 4), none without data
#     parallelism or with TERA_ZERO_SHARED=0 (dp2-noshared: the same bytes and final loss as dp2);
#     ZeRO-1/2 gather their updated parameters there once a step (zero_shared_param_gathers_per_step 1),
#     no other layout;
#   - the time blocked in communication (exposed_comm_ms) is positive, and its split by the kind of
#     operation waited for (exposed_comm_ms_by_kind) adds up to it, has no point-to-point time without
#     a pipeline or expert parallelism and no all-to-all time without expert parallelism, and some
#     point-to-point time with a pipeline;
#   - the whole: bytes_sent_per_step equals the minimum plus the overhead (5 bytes), and the
#     overhead is small (under 5% of the minimum + 1 KiB), except with expert parallelism: the
#     rows exchanged point-to-point follow the routing, the minimum assumes uniform routing, so
#     there the point-to-point bytes must lie within 10% of it and the whole within 5%; under
#     model.router_force_balance (ep2-balanced: every expert the same rows) exactly the minimum, and the
#     busiest expert-parallel rank's rows exactly the mean (ep_load_max_over_mean 1);
#   - sequence parallelism (the -sp layouts) is reported in effect (sequence_parallel 1, else 0); its
#     reduce-scatters and all-gathers replace the [N, D] all-reduces byte for byte (the minimum above,
#     with its norm-gradient all-reduces), the same sums overlap the weight gradients (9 per micro-batch
#     on tp2), and a rank's activations are smaller than without it (tp2, tp2xpp2);
#   - with a pipeline, each stage's busy and waiting milliseconds per step (pp_stage_busy_ms,
#     pp_stage_wait_ms: one per stage, every stage busy, busy + waiting within the step), none without;
#   - every rank's per-operation profile (ops_ms_by_rank): the head only on the last stage's ranks and
#     the embedding only on the first's (every rank without a pipeline), the tensor-parallel sums on
#     every rank with tp > 1 and on none without;
#   - parallel.pp_head_split (pp2-hs, pp2xdp2-zero1-hs, tp2xpp2-hs: a pair per vocabulary slice): the
#     head's split adds its point-to-point transfers to the minimum (the weight's and gradient's
#     half-rows once a step; per micro-batch the final norm's output one way, the helper's input gradient
#     the other, the cross-entropy's maxima and sums both ways) and sends exactly that; the head runs on
#     the first stage's ranks too, whose messages to the last stage count as tensor-parallel comm; the
#     JSON says pp_head_split 1.
# Usage: cli_benchdist.sh TERA SOURCE_DIR
set -u
TERA=$1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" # Open MPI's own allocations (see cli_dist.sh)
command -v mpirun > /dev/null || { echo "skip: mpirun not installed"; exit 0; }
. "$(dirname "$0")/testlib.sh"
TINY=(--model.dim=32 --model.n_layers=3 --model.n_heads=4 --model.n_experts=4 --model.ffn_dim=32 --model.vocab_size=256
      --model.first_k_dense=1 --model.n_shared_experts=1 --training.seq_len=32 --training.micro_batch=2
      --training.threads=1 --steps 2 --warmup 1)
num() { grep -o "\"$2\": [-0-9.e+]*" "$1" | head -1 | cut -d' ' -f2; } # a number of the JSON line
# a per-step time's mean over the ranks and busiest rank: present, the max at least the mean, and the
# mean positive (third argument 1) or at least 0
mean_max() { awk -v m="$1" -v x="$2" -v pos="$3" 'BEGIN { exit !(m != "" && (pos ? m > 0 : m >= 0) && x >= m) }'; }

# name parallel.dp parallel.tp parallel.ep zero grad_accum [parallel.pp] [extra option]
# (dp2-switchdp: model.balance_loss = switch_dp's count all-reduces, rerun by the full recomputation
# of layers 0-1, not by layer 2's: the work set still holds it)
for l in dp2:2:1:1:0:1 dp2-noshared:2:1:1:0:1 tp2:1:2:1:0:1 ep2:2:1:2:0:1 dp2-zero3:2:1:1:3:2 dp2-zero3-rsoff:2:1:1:3:2 \
         dp2-zero3-noshared:2:1:1:3:2 dp2-zero2:2:1:1:2:2 \
         dp2-zero1:2:1:1:1:2 dp2-zero1-rsoff:2:1:1:1:2 dp4xep2-zero1:4:1:2:1:1 pp2:1:1:1:0:2:2 tp2xpp2:1:2:1:0:2:2 \
         pp2xdp2-zero3:2:1:1:3:4:2 tp2-noov:1:2:1:0:1:1:--parallel.tp_overlap=0 \
         tp2-bf16:1:2:1:0:1:1:--training.precision=bf16 "tp2-bf16-ov2:1:2:1:0:1:1:--training.precision=bf16 --parallel.tp_overlap=2" \
         "dp2-switchdp:2:1:1:0:2:1:--model.balance_loss=switch_dp --training.recompute=full" \
         "ep2-balanced:2:1:2:0:1:1:--model.router_force_balance=true" \
         "tp2-sp:1:2:1:0:1:1:--parallel.sequence_parallel=true" "tp2xpp2-sp:1:2:1:0:2:2:--parallel.sequence_parallel=true" \
         "pp2-hs:1:1:1:0:4:2:--parallel.pp_head_split=true" "pp2xdp2-zero1-hs:2:1:1:1:4:2:--parallel.pp_head_split=true" \
         "tp2xpp2-hs:1:2:1:0:4:2:--parallel.pp_head_split=true" \
         "pp2-hs-dw:1:1:1:0:4:2:--parallel.pp_head_split=true --parallel.pp_defer_wgrad=4"; do
    IFS=: read -r name dp tp ep zero accum pp extra <<< "$l"
    pp=${pp:-1}
    out="$W/$name.json"
    envs=()
    [[ "$name" = *-rsoff ]] && envs=(env TERA_ZERO_RS_OVERLAP=0)
    [[ "$name" = *-noshared ]] && envs=(env TERA_ZERO_SHARED=0)
    if ! mpirun --oversubscribe -np $((pp * dp * tp)) ${envs[@]+"${envs[@]}"} "$TERA" bench "${TINY[@]}" --parallel.dp="$dp" --parallel.tp="$tp" \
        --parallel.ep="$ep" --parallel.zero="$zero" --parallel.pp="$pp" --training.grad_accum="$accum" ${extra:-} \
        > "$out" 2> "$W/$name.err"; then
        fail "$name: bench failed"
        tail -5 "$W/$name.err"
        continue
    fi
    ok=1
    for k in allreduce reduce_scatter allgather alltoall; do
        s=$(num "$out" "sent_$k") m=$(num "$out" "min_$k") o=$(num "$out" "overhead_$k")
        if [ -z "$s" ] || ! awk -v s="$s" -v m="$m" -v o="$o" 'BEGIN { d = s - m - o; exit !(d <= 1 && d >= -1) }'; then
            fail "$name: $k sent ${s:-?} bytes per step, expected $m (minimum) + $o (overhead)"
            ok=0
        fi
    done
    s=$(num "$out" sent_p2p) m=$(num "$out" min_p2p)
    ptol=$([[ "${extra:-}" = *router_force_balance=true* ]] && echo 0 || echo 0.1) # forced balance: exactly uniform
    if ! awk -v s="$s" -v m="$m" -v t="$ptol" 'BEGIN { exit !(m == 0 ? s == 0 : s >= (1 - t) * m && s <= (1 + t) * m) }'; then
        fail "$name: point-to-point $s bytes per step, minimum $m (uniform routing), tolerance $ptol"
        ok=0
    fi
    tot=$(num "$out" bytes_sent_per_step) min=$(num "$out" min_bytes_per_step) over=$(num "$out" overhead_bytes_per_step)
    tol=$([ "$ep" -gt 1 ] && echo 0.05 || echo 0)
    if ! awk -v s="$tot" -v m="$min" -v o="$over" -v t="$tol" \
        'BEGIN { d = s - m - o; if (d < 0) d = -d; exit !(m > 0 && o < 0.05 * m + 1024 && d <= t * m + 5) }'; then
        fail "$name: $tot bytes sent per step, analytic minimum $min + overhead $over, tolerance $tol"
        ok=0
    fi
    # the time blocked in communication per step (mean and busiest rank) is reported, positive (every
    # layout here communicates every step) and consistent
    e=$(num "$out" exposed_comm_ms) emax=$(num "$out" exposed_comm_ms_max)
    mean_max "$e" "$emax" 1 || { fail "$name: exposed communication ${e:-?} ms per step (max rank ${emax:-?})"; ok=0; }
    # ... and by the kind of operation waited for: the kinds add up to it; none of a kind the layout does
    # not use (point-to-point: pipeline or expert parallelism; all-to-all: expert parallelism); the
    # pipeline's activation receives block in point-to-point waits
    bk=$(grep -o '"exposed_comm_ms_by_kind": {[^}]*}' "$out")
    if ! echo "$bk" | sed 's/.*{//; s/}//' | tr ',' '\n' | awk -v e="$e" -v pp="$pp" -v ep="$ep" -F: '{
            k = $1; gsub(/[ "]/, "", k); v[k] = $2 + 0; s += v[k]; n++ }
         END { d = s - e; if (d < 0) d = -d
               exit !(n == 6 && d <= 0.011 && (pp > 1 || ep > 1 || v["p2p"] == 0) && (ep > 1 || v["alltoall"] == 0) && (pp == 1 || v["p2p"] > 0)) }'; then
        fail "$name: blocked time by kind ${bk:-missing}, total $e ms"
        ok=0
    fi
    ov=$(num "$out" tp_overlapped_per_step) want=0
    if [ "$tp" -gt 1 ] && [[ "${extra:-}" != *tp_overlap=0* ]] && { [[ "${extra:-}" != *bf16* ]] || [[ "${extra:-}" = *tp_overlap=2* ]]; }; then
        want=$([ "$pp" = 1 ] && echo $((9 * accum)) || echo some)
    fi
    if ! awk -v v="$ov" -v w="$want" 'BEGIN { exit !(v != "" && (w == "some" ? v > 0 : v == w)) }'; then
        fail "$name: ${ov:-?} tensor-parallel sums overlapped per step, expected $want"
        ok=0
    fi
    rs=$(num "$out" zero_rs_per_step) rso=$(num "$out" zero_rs_overlapped_per_step)
    if [ "$zero" -ge 1 ] && [[ "$name" != *-rsoff ]]; then
        awk -v a="$rs" -v b="$rso" 'BEGIN { exit !(a != "" && a > 0 && b == a) }' || {
            fail "$name: ${rso:-?} of ${rs:-?} ZeRO gradient reduce-scatters per step started non-blocking, expected all"
            ok=0
        }
    elif [ "$zero" -ge 1 ]; then
        # (ZeRO-1 blocking: one reduce-scatter per region after the backward, not counted)
        awk -v a="$rs" -v b="$rso" -v z="$zero" 'BEGIN { exit !(a != "" && (z == 1 ? a == 0 : a > 0) && b == 0) }' || {
            fail "$name: ${rso:-?} of ${rs:-?} ZeRO gradient reduce-scatters per step started non-blocking, expected none"
            ok=0
        }
        l0=$(num "$W/${name%-rsoff}.json" final_loss) l1=$(num "$out" final_loss)
        [ -n "$l1" ] && [ "$l0" = "$l1" ] || { fail "$name: final loss $l1, overlapped ${name%-rsoff}: $l0"; ok=0; }
    elif [ "${rs:-0}" != 0.0 ] || [ "${rso:-0}" != 0.0 ]; then
        fail "$name: ${rs:-?} ZeRO gradient reduce-scatters per step (${rso:-?} non-blocking) without ZeRO"
        ok=0
    fi
    # ZeRO-3's layer gathers: every one in host-shared memory (the ranks share this host), none with
    # TERA_ZERO_SHARED=0 (dp2-zero3-noshared: all-gathers, the same bytes above and the same final loss)
    zg=$(num "$out" zero3_gathers_per_step) zs=$(num "$out" zero3_shared_gathers_per_step)
    zwant=$([ "$zero" = 3 ] && [[ "$name" != *-noshared ]] && echo all || echo 0)
    if ! awk -v g="$zg" -v s="$zs" -v w="$zwant" -v z="$zero" \
        'BEGIN { exit !(g != "" && s != "" && (z == 3 ? g > 0 : g == 0) && (w == "all" ? s == g : s == 0)) }'; then
        fail "$name: ${zs:-?} of ${zg:-?} ZeRO-3 layer gathers per step in host-shared memory, expected $zwant"
        ok=0
    fi
    if [[ "$name" = *-noshared ]]; then
        l0=$(num "$W/${name%-noshared}.json" final_loss) l1=$(num "$out" final_loss)
        [ -n "$l1" ] && [ "$l0" = "$l1" ] || { fail "$name: final loss $l1, in host-shared memory: $l0"; ok=0; }
    fi
    # the gradient sums straight from the ranks' buffers in host-shared memory: with data parallelism
    # (every ZeRO stage; ZeRO-1 with its reduce-scatters overlapped), none without it or with
    # TERA_ZERO_SHARED=0
    ss=$(num "$out" zero_shared_sums_per_step)
    swant=$([ "$dp" -gt 1 ] && [[ "$name" != *-noshared ]] && { [ "$zero" != 1 ] || [[ "$name" != *-rsoff ]]; } && echo some || echo 0)
    awk -v s="$ss" -v w="$swant" 'BEGIN { exit !(s != "" && (w == "some" ? s > 0 : s == 0)) }' || {
        fail "$name: ${ss:-?} gradient sums per step in host-shared memory, expected $swant"
        ok=0
    }
    # ZeRO-1/2's all-gather of the updated parameters in host-shared memory, once a step (the pieces
    # written straight into the other ranks' buffers; the bytes above counted as the all-gather), none
    # for other stages or with TERA_ZERO_SHARED=0
    pgs=$(num "$out" zero_shared_param_gathers_per_step)
    pwant=$([ "$dp" -gt 1 ] && { [ "$zero" = 1 ] || [ "$zero" = 2 ]; } && [[ "$name" != *-noshared ]] && echo 1 || echo 0)
    awk -v s="$pgs" -v w="$pwant" 'BEGIN { exit !(s != "" && s == w) }' || {
        fail "$name: ${pgs:-?} parameter all-gathers per step in host-shared memory, expected $pwant"
        ok=0
    }
    # the time spent starting and polling non-blocking operations: reported, mean and busiest rank
    # (microseconds here, where the shared segment sums this tiny model's buffers)
    pg=$(num "$out" comm_progress_ms) pgmax=$(num "$out" comm_progress_ms_max)
    mean_max "$pg" "$pgmax" 0 || {
        fail "$name: ${pg:-?} ms per step in starting and polling non-blocking operations (max rank ${pgmax:-?})"
        ok=0
    }
    # the expert-parallel ranks' share of the routed rows: the busiest over the mean, between 1 and ep
    # (exactly 1 without expert parallelism, and with model.router_force_balance: ep2-balanced)
    im=$(num "$out" ep_load_max_over_mean) fb=$([[ "${extra:-}" = *router_force_balance=true* ]] && echo 1 || echo 0)
    [ "$(num "$out" router_force_balance)" = "$fb" ] || { fail "$name: router_force_balance $(num "$out" router_force_balance), expected $fb"; ok=0; }
    if ! awk -v v="$im" -v e="$ep" -v fb="$fb" 'BEGIN { exit !(v != "" && (e == 1 || fb ? v == 1 : v >= 1 && v <= e)) }'; then
        fail "$name: expert-parallel load max/mean ${im:-?} with ep $ep"
        ok=0
    fi
    spw=$([[ "${extra:-}" = *sequence_parallel=true* ]] && echo 1 || echo 0)
    [ "$(num "$out" sequence_parallel)" = "$spw" ] || { fail "$name: sequence_parallel $(num "$out" sequence_parallel), expected $spw"; ok=0; }
    if [ "$spw" = 1 ]; then
        a0=$(num "$W/${name%-sp}.json" mem_acts) a1=$(num "$out" mem_acts)
        awk -v a="$a0" -v b="$a1" 'BEGIN { exit !(a != "" && b != "" && b < a) }' || {
            fail "$name: activations $a1 bytes a rank, ${a0:-?} without sequence parallelism"
            ok=0
        }
    fi
    # a pipeline: each stage's busy and waiting time per step (one number per stage, every stage busy, the
    # two within the step: the pipeline's part of it); none without a pipeline
    if ! jq -e --argjson pp "$pp" --argjson step "$(num "$out" step_ms_median)" '
            if $pp == 1 then (has("pp_stage_busy_ms") or has("pp_stage_wait_ms")) | not
            else (.pp_stage_busy_ms | length) == $pp and (.pp_stage_wait_ms | length) == $pp
                 and all(.pp_stage_busy_ms[]; . > 0) and all(.pp_stage_wait_ms[]; . >= 0)
                 and ([.pp_stage_busy_ms, .pp_stage_wait_ms] | transpose | all(.[0] + .[1] <= 1.5 * $step + 1)) end' \
            "$out" > /dev/null; then
        fail "$name: pipeline stages' busy / waiting ms $(jq -c '[.pp_stage_busy_ms, .pp_stage_wait_ms]' "$out") with pp $pp, step $(num "$out" step_ms_median) ms"
        ok=0
    fi
    # every rank's operations (ops_ms_by_rank, ms per step, one entry per rank): every rank runs the
    # layers' products; with a pipeline only the first stage's ranks embed and only the last stage's run
    # the head (the ranks of stage s are s * n / pp .. (s + 1) * n / pp - 1), without one every rank
    # does both; the tensor-parallel sums are timed on every rank exactly when tp > 1
    hs=$([[ "${extra:-}" = *pp_head_split=true* ]] && echo 1 || echo 0)
    if ! jq -e --argjson n "$((pp * dp * tp))" --argjson pp "$pp" --argjson tp "$tp" --argjson hs "$hs" '
            (.ops_ms_by_rank | to_entries | all(.value | length == $n))
            and all(.ops_ms_by_rank["qkv proj fwd"][]; . > 0)
            and ([.ops_ms_by_rank["lm head fwd"], .ops_ms_by_rank["embedding fwd"]] | transpose | to_entries
                 | all((.value[0] > 0) == (.key >= $n - $n / $pp or ($hs == 1 and .key < $n / $pp))
                       and (.value[1] > 0) == (.key < $n / $pp)))
            and (if $tp > 1 or $hs == 1 then all(.ops_ms_by_rank["tensor-parallel comm"][]; . > 0)
                 else .ops_ms_by_rank | has("tensor-parallel comm") | not end)
            and (.pp_head_split // 0) == $hs' "$out" > /dev/null; then
        fail "$name: operations by rank $(jq -c '.ops_ms_by_rank | {"lm head fwd", "embedding fwd", "qkv proj fwd", "tensor-parallel comm"}' "$out") with pp $pp, tp $tp"
        ok=0
    fi
    [ "$ok" = 1 ] && pass "$name: $tot bytes per step, minimum $min; $e ms per step blocked in communication (max rank $emax; ${bk#*: }), $pg ms progressing non-blocking ones; $ov tp sums overlapped; $rso of $rs ZeRO reduce-scatters overlapped"
done
finish cli_benchdist
