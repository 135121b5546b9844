#!/usr/bin/env bash
# docs/CONFIG.md is generated from the key table: fail when it is stale (regenerate: make docs).
set -u
TERA=$1
SRC=$2
if "$TERA" config --doc | cmp -s - "$SRC/docs/CONFIG.md"; then
    echo "docs/CONFIG.md is up to date"
else
    echo "FAIL: docs/CONFIG.md differs from 'tera config --doc' (run: make docs)"
    "$TERA" config --doc | diff "$SRC/docs/CONFIG.md" - | head -20
    exit 1
fi
