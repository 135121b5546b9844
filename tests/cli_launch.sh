#!/usr/bin/env bash
# tera launch gives its job an Open MPI session directory of its own on this host: under the shared
# /tmp/ompi.HOST.UID, one job's clean-up removes the emptied top directory while another job started
# beside it is creating its own inside, failing that job at start ('orte_session_dir failed';
# docs/PARALLELISM.md, Launch). Checked here:
#  1. without OMPI_MCA_orte_tmpdir_base, mpirun gets $TMPDIR/tera-launch.UID.PID (the start event's
#     mpi_session_base), which the supervisor removes at the end with what a job left inside;
#  2. a base the caller set is passed on unchanged and left in place;
#  3. a real two-rank job: every rank's top session directory lies under the launch's own base, the
#     run trains, and the base is gone afterwards.
# (1 and 2 use a stand-in for mpirun that records its environment; tests/cli_elastic.sh covers the
# supervisor's failure handling on several hosts.)
# Usage: cli_launch.sh TERA SOURCE_DIR
set -u
TERA=$1
SRC=$2
. "$(dirname "$0")/mpilib.sh"
mkdir -p "$W/tmp"
start_field() { grep '"event": "start"' "$1/elastic/events.jsonl" | tail -1 | jq -r ".$2"; }

# a stand-in for mpirun: records the base it was given and leaves a file inside, as a killed job would
cat > "$W/fake-mpirun" <<'EOF'
#!/bin/sh
echo "${OMPI_MCA_orte_tmpdir_base:-unset}" > "$FAKE_OUT"
if [ -n "${OMPI_MCA_orte_tmpdir_base:-}" ]; then
    mkdir -p "$OMPI_MCA_orte_tmpdir_base/ompi.left/1" && echo x > "$OMPI_MCA_orte_tmpdir_base/ompi.left/1/f"
fi
exit 0
EOF
chmod +x "$W/fake-mpirun"

# 1. no base set: the launch's own, removed at the end
env -u OMPI_MCA_orte_tmpdir_base TMPDIR="$W/tmp" FAKE_OUT="$W/fake1" "$TERA" launch --hosts localhost:1 \
    --mpirun "$W/fake-mpirun" -- "$TERA" train "${MODEL[@]}" --logging.run_dir="$W/r1" > "$W/l1.log" 2>&1 \
    || fail "launch with the stand-in: exit status ($(tail -3 "$W/l1.log"))"
got=$(cat "$W/fake1" 2> /dev/null)
ev=$(start_field "$W/r1" mpi_session_base)
case "$got" in
"$W/tmp/tera-launch.$(id -u)."*) [ "$got" = "$ev" ] && pass "own session base given to mpirun: $got" \
                                     || fail "mpirun got $got, the start event says $ev" ;;
*) fail "mpirun's OMPI_MCA_orte_tmpdir_base: '$got', expected $W/tmp/tera-launch.$(id -u).PID" ;;
esac
[ -n "$ev" ] && [ "$got" = "$ev" ] && [ ! -e "$ev" ] && pass "own session base removed at the end, with what was left inside" \
    || fail "own session base '$ev' (mpirun got '$got') not removed or not used: $(find "$ev" 2> /dev/null | head -3 | tr '\n' ' ')"

# 2. the caller's base: passed on, left alone
OMPI_MCA_orte_tmpdir_base="$W/mine" FAKE_OUT="$W/fake2" "$TERA" launch --hosts localhost:1 --mpirun "$W/fake-mpirun" \
    -- "$TERA" train "${MODEL[@]}" --logging.run_dir="$W/r2" > "$W/l2.log" 2>&1 || fail "launch with a base set"
[ "$(cat "$W/fake2" 2> /dev/null)" = "$W/mine" ] && [ "$(start_field "$W/r2" mpi_session_base)" = "$W/mine" ] \
    && [ -f "$W/mine/ompi.left/1/f" ] && pass "the caller's session base passed on and left in place" \
    || fail "the caller's base: mpirun got '$(cat "$W/fake2" 2> /dev/null)', files $(find "$W/mine" | wc -l)"

# 3. a real two-rank job; each rank records its top session directory, then runs tera
cat > "$W/rank" <<EOF
#!/bin/sh
echo "\${OMPI_MCA_orte_top_session_dir:-none}" > "$W/rank-\${OMPI_COMM_WORLD_RANK:-x}"
exec "$TERA" "\$@"
EOF
chmod +x "$W/rank"
env -u OMPI_MCA_orte_tmpdir_base TMPDIR="$W/tmp" "$TERA" launch --hosts localhost:2 -- "$W/rank" train "${MODEL[@]}" \
    --parallel.dp=2 --training.steps=3 --logging.run_dir="$W/r3" > "$W/l3.log" 2>&1 \
    || fail "two-rank launch: exit status ($(tail -3 "$W/l3.log"))"
base=$(start_field "$W/r3" mpi_session_base)
n=0
for r in 0 1; do case "$(cat "$W/rank-$r" 2> /dev/null)" in "$base"/ompi.*) n=$((n + 1)) ;; esac; done
[ "$n" = 2 ] && pass "both ranks' session directories under the launch's base ($base)" \
    || fail "ranks' session directories: $(cat "$W"/rank-* 2> /dev/null | tr '\n' ' '), base $base"
[ "$(last_fields "$W/r3/metrics.jsonl" step | wc -l)" = 3 ] && pass "the two-rank job trained 3 steps" \
    || fail "two-rank job: steps '$(last_fields "$W/r3/metrics.jsonl" step | tr '\n' ' ')'"
[ -n "$base" ] && [ ! -e "$base" ] && pass "the two-rank job's session base removed" || fail "left: $base"
[ -z "$(ls -A "$W/tmp")" ] && pass "nothing left under TMPDIR" || fail "left under TMPDIR: $(ls "$W/tmp")"
finish cli_launch
