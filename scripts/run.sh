#!/usr/bin/env bash
# The main job on a fresh machine: fetch the default model, build, generate.
# Usage: scripts/run.sh ["prompt"] [extra keydiff run flags...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v cargo >/dev/null || { echo "error: cargo not found; install Rust with rustup" >&2; exit 1; }
scripts/fetch-models.sh smollm2
cargo build --release -p keydiff-cli
prompt=${1:-"Explain in two sentences why the sky is blue."}
shift || true
exec target/release/keydiff run --chat -p "$prompt" -n 128 "$@"
