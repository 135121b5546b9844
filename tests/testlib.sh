# Shared by the tests/cli_*.sh scripts (sourced): a scratch directory removed on exit, and the
# pass/fail counters. Each script ends with `finish NAME`.
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
fails=0
pass() { echo "ok: $1"; }
fail() { echo "FAIL: $1"; fails=$((fails + 1)); }
finish() {
    echo "$1: $fails failed"
    [ "$fails" = 0 ]
}
