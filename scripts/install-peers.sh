#!/usr/bin/env bash
# The Python peers that tests compare tera with (Hugging Face transformers/tokenizers, TensorBoard,
# MLflow, Optuna), in one virtual environment outside the repository, on top of Debian's Python and
# its PyTorch (python3-torch). Idempotent: a stamp holding the requirements' hash skips the work when
# nothing changed. Prints the environment's python on stdout; exits non-zero (with a message) when it
# cannot be built (no network): tests that need it then skip, naming the reason.
# Usage: scripts/install-peers.sh            -> path of the venv's python
#        TERA_PEERS_VENV=DIR overrides the location (default ~/.cache/tera/peers-venv).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
req="$here/peers-requirements.txt"
venv="${TERA_PEERS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tera/peers-venv}"
stamp="$venv/.tera-stamp"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi
# Debian's interpreter (its python3-torch lives there), its venv module, and the torch the peers use
need=()
for p in python3-venv python3-torch python3-numpy; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" != "0" ] && SUDO="sudo"
  echo "tera: installing Debian packages for the Python peers: ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
lock="$venv.lock"
mkdir -p "$(dirname "$venv")"
exec 9>"$lock"
flock 9 # concurrent tests wait for one installer
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "$venv/bin/python"
  exit 0
fi
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv" >&2
echo "tera: installing the Python peers into $venv (once)" >&2
if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req" >&2; then
  echo "tera: could not install the Python peers (scripts/peers-requirements.txt) into $venv" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "$venv/bin/python"
