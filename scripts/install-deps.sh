#!/usr/bin/env bash
# Install the Debian packages tera needs. Idempotent; silent when everything is present.
# Usage: scripts/install-deps.sh [--with-torch]   (--with-torch adds PyTorch for fixtures/bench peers)
set -euo pipefail

pkgs=(
  build-essential cmake pkg-config
  libdnnl-dev          # oneDNN: matrix products (AVX-512 / AMX dispatch)
  libinih-dev          # INI parser for the human-editable config files
  libcjson-dev         # JSON: config resolve, safetensors headers, metrics, manifests
  libpcre2-dev         # tokenizer pre-tokenizer regular expression
  libzstd-dev          # checkpoint compression
  zlib1g-dev           # gzip shards of online tokenization (data.tokenizer, src/data/online.c)
  libxxhash-dev        # checksums and chunk hashes
  libcmocka-dev        # C unit-test framework (under ctest)
  libopenmpi-dev openmpi-bin  # multi-process communication
  strace               # tests: tests/cli_ckpt.sh kills the trainer at each unlink of checkpoint retention
  jq                   # tests: tests/cli_errors.sh checks that metrics.jsonl and state.json are JSON
  libmicrohttpd-dev    # the Prometheus /metrics endpoint (logging.metrics_port, src/obs/metrics_http.c)
  libsqlite3-dev       # the run registry (logging.registry, src/obs/registry.c; tera runs, tera tune studies)
  libcurl4-openssl-dev # MLflow REST client (logging.mlflow_uri, src/obs/mlflow.c)
  sqlite3              # tests: tests/cli_tune.sh reads the study and trial tables of the registry
  prometheus curl      # tests: tests/cli_prometheus.sh scrapes tera with a real Prometheus; promtool checks deploy/prometheus rules
  chromium             # tests: tests/cli_report.sh renders `tera report`'s HTML headless (DOM dump and a screenshot)
)
if [ "${1:-}" = "--with-torch" ]; then
  # OpenBLAS becomes the system libblas.so.3 (alternatives), which Debian's PyTorch uses for fp32
  # matrix products: the PyTorch peer's best honest fp32 configuration (docs/PERFORMANCE.md)
  pkgs+=(python3-torch python3-numpy libopenblas0-pthread)
fi

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "tera: installing missing Debian packages: ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
