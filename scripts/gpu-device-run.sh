#!/usr/bin/env bash
# The device tool's side of a GPU check: unpacks the binary carried in .gpu/keydiff.gz (see
# gpu-check.sh's header for how to pack it; the flash build, target/cuda-flash, is 28 MB
# gzipped and checks everything the plain one does), finds the CUDA libraries ldd misses, runs
# gpu-check.sh with its logs outside $OUT, then packs them into $OUT (at most 8 files come
# back): gpu-check.tgz, summary.txt, ldd.txt. Call through the device tool with carry [".gpu"]:
#   bash scripts/gpu-device-run.sh        (GPU_CHECK_TIMEOUT_S, default 520, bounds the check)
# Back here, `python3 scripts/gpu-results.py <files_at>/gpu-check.tgz` drafts the results page.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
back=${OUT:?the device tool sets OUT}
gunzip -c .gpu/keydiff.gz > /tmp/keydiff && chmod +x /tmp/keydiff || exit 1
if nv=$(python3 -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))' 2>/dev/null); then
  export LD_LIBRARY_PATH=$nv:${LD_LIBRARY_PATH:-}
fi
# Any library still missing: the first copy under the usual prefixes.
for lib in $(ldd /tmp/keydiff | awk '/not found/ {print $1}'); do
  p=$(timeout 20 find /usr /opt /root /home -name "$lib" -print -quit 2>/dev/null)
  [ -n "$p" ] && export LD_LIBRARY_PATH=$(dirname "$p"):$LD_LIBRARY_PATH
done
{ echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; ldd /tmp/keydiff; } > "$back/ldd.txt"
rm -rf /tmp/gc; mkdir -p /tmp/gc
OUT=/tmp/gc KEYDIFF_BIN=/tmp/keydiff timeout "${GPU_CHECK_TIMEOUT_S:-520}" bash scripts/gpu-check.sh \
  > /tmp/gc.log 2>&1
echo "gpu-check exit: $?" >> /tmp/gc.log
tar czf "$back/gpu-check.tgz" -C /tmp gc gc.log
cp /tmp/gc/summary.txt "$back/" 2>/dev/null
tail -c 9000 /tmp/gc.log
