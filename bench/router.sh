#!/usr/bin/env bash
# The router at many experts (docs/PERFORMANCE.md, "The router at 4096 experts"): runs
# bench_router RUNS times (default 3) and prints each cell's median over the runs (each run's cell
# is itself the median of its repetitions).
# Usage: bench/router.sh [BENCH_ROUTER] [bench_router options...]   e.g.
#   bench/router.sh build/bench/bench_router --threads 2 --reps 15
set -euo pipefail
BIN=${1:-build/bench/bench_router}
shift || true
RUNS=${RUNS:-3}
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for r in $(seq "$RUNS"); do "$BIN" "$@" | sed "s/^/$r|/" >> "$tmp"; done
head -1 "$tmp" | cut -d'|' -f2- | sed "s/median of/median over $RUNS runs of medians of/"
# rows of numbers: "variant name   v1 v2 ... v8"; the variant name may hold spaces and commas
awk -F'|' '
  $2 ~ /^variant/ { if (!hdr++) print $2; next }
  $2 ~ /^router|^gate/ { next }
  {
    line = $2; n = split(line, f, " "); nv = 8; name = ""
    for (i = 1; i <= n - nv; i++) name = name (i > 1 ? " " : "") f[i]
    if (!(name in seen)) { seen[name] = 1; order[++no] = name }
    runs[name]++
    for (j = 1; j <= nv; j++) v[name, j, runs[name]] = f[n - nv + j]
  }
  END {
    for (o = 1; o <= no; o++) {
      name = order[o]; printf "%-28s", name
      for (j = 1; j <= nv; j++) {
        m = runs[name]; delete a
        for (r = 1; r <= m; r++) a[r] = v[name, j, r]
        for (x = 1; x <= m; x++) for (y = x + 1; y <= m; y++) if (a[y] + 0 < a[x] + 0) { t = a[x]; a[x] = a[y]; a[y] = t }
        med = (m % 2) ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2
        printf " %9.3f", med
      }
      printf "\n"
    }
  }' "$tmp"
grep '|gate products' "$tmp" | cut -d'|' -f2- | sed 's/^/run: /'
