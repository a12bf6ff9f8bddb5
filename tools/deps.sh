#!/usr/bin/env bash
# Installs the one system library the build needs (OpenBLAS for the CPU reference matmuls) when it
# is missing and this machine can install it; otherwise says what to do. Idempotent and quiet.
set -u
for l in /usr/lib/x86_64-linux-gnu/libopenblas.so /usr/lib/aarch64-linux-gnu/libopenblas.so /usr/lib/libopenblas.so /usr/lib64/libopenblas.so; do
  [ -e "$l" ] && exit 0
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "deps: installing libopenblas-dev" >&2
  export DEBIAN_FRONTEND=noninteractive
  (apt-get install -y -qq libopenblas-dev >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libopenblas-dev >/dev/null 2>&1; }) && exit 0
fi
echo "deps: no OpenBLAS found and it cannot be installed here; building with plain C matmuls (TSYS_NO_CBLAS, slow)" >&2
exit 0
