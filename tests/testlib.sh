# Shared by the tests/cli_*.sh scripts (sourced): a scratch directory removed on exit, and the
# pass/fail counters. Each script ends with `finish NAME`.
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
# Open MPI's session directories away from the shared /tmp/ompi.HOST.UID, whose clean-up by one job can
# fail another starting beside it (tests/CMakeLists.txt sets one per test; this covers a script run by hand)
export OMPI_MCA_orte_tmpdir_base="${OMPI_MCA_orte_tmpdir_base:-$W/ompi}"
fails=0
pass() { echo "ok: $1"; }
fail() { echo "FAIL: $1"; fails=$((fails + 1)); }
finish() {
    echo "$1: $fails failed"
    [ "$fails" = 0 ]
}

# Metrics by field name. steps_of FILE: "step loss grad_norm skipped" of every step record of a
# metrics.jsonl (a line with "loss" and no "event"); a missing field reads "-", a non-finite one "null".
steps_of() {
    awk 'function f(k,  s) { if (!match($0, "\"" k "\": [^,}]*")) return "-"; s = substr($0, RSTART, RLENGTH)
                             sub(/^[^:]*: /, "", s); return s }
         /"loss": / && !/"event"/ { print f("step"), f("loss"), f("grad_norm"), f("skipped") }' "$1"
}
# fields FILE NAME...: the named fields of every step record, space-separated, one record a line;
# last_fields FILE NAME...: the same, keeping only the last record of each step (a resumed run or a
# rollback logs some steps twice), sorted by step (the first name must be step)
fields() {
    local f=$1
    shift
    awk -v names="$*" 'BEGIN { n = split(names, k, " ") }
         function f(key,  s) { if (!match($0, "\"" key "\": [^,}]*")) return "-"; s = substr($0, RSTART, RLENGTH)
                               sub(/^[^:]*: /, "", s); return s }
         /"loss": / && !/"event"/ { line = f(k[1]); for (i = 2; i <= n; i++) line = line " " f(k[i]); print line }' "$f"
}
last_fields() { fields "$@" | awk '{ r[$1] = $0 } END { for (s in r) print r[s] }' | sort -n; }
# compare_steps A B TOL [N]: the step records of two metrics files have the same steps and skips, and
# loss and grad_norm agree to relative TOL (0: identical as printed); with N, the last N records of A
# against all of B. Prints "K steps, worst relative difference X" (and the steps at fault); fails on
# a mismatch, or when there is no record.
compare_steps() {
    paste -d' ' <(if [ -n "${4:-}" ]; then steps_of "$1" | tail -n "$4"; else steps_of "$1"; fi) <(steps_of "$2") |
        awk -v tol="$3" '
        function rel(x, y,  d) { if (x == y) return 0; if (x == "null" || y == "null") return 1e30
                                 d = (x - y) / (x < 0 ? -x : x); return d < 0 ? -d : d }
        { n++; if (NF != 8 || $1 != $5 || $4 != $8) { bad = 1; print "record " n " differs: " $0; next }
          for (i = 2; i <= 3; i++) { r = rel($i, $(i + 4)); if (r > worst) worst = r
                                     if (r > tol) { bad = 1; print "step " $1 ": " $i " vs " $(i + 4) } } }
        END { printf "%d steps, worst relative difference %.2g\n", n, worst; exit bad || n == 0 }'
}
# untimed FILE: a metrics file without its timing fields (a pipeline's stage times included), for
# bit-identity checks (cmp)
untimed() { grep -v '"event": "memory"' "$1" | sed -E 's/"tokens_per_s[^,]*,//; s/"elapsed_s[^,]*,//; s/"step_s[^,]*,//; s/"data_wait_s[^,]*,//; s/"comm_wait_s[^,]*,//; s/"model_tflops[^,]*,//; s/"mfu[^,]*,//; s/"pp_(busy|wait)_s": \[[^]]*\], //g'; }
# within A B TOL: |A - B| <= TOL * |A| (and A > 0)
within() { awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a > 0 && d <= t * a) }'; }

# peer_python: the python of the peers' virtual environment (transformers, tokenizers, TensorBoard,
# MLflow, Optuna; scripts/install-peers.sh builds it once). Prints nothing and fails when it cannot be
# built; callers then skip with a message: PY=$(peer_python) || { echo "skip: ..."; exit 0; }
peer_python() { "$(dirname "${BASH_SOURCE[0]}")/../scripts/install-peers.sh" 2>/dev/null; }
