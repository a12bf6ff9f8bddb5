#!/usr/bin/env bash
# Installs what the build and the tests need when it is missing and this machine can install it
# (root with apt-get); otherwise says what to do. Idempotent and quiet.
#   OpenBLAS (libopenblas-dev)   the CPU reference matmuls; without it: plain C loops (TSYS_NO_CBLAS, slow)
#   clang + its libFuzzer runtime (clang, libclang-rt-dev)   make test's fuzzing stage; without it the
#                                fuzzers are skipped (the rest of make test runs)
#   cmake, pkg-config            tests/test_packaging.sh (consumer builds); without them its cases are skipped
set -u
can_install() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }
apt_install() {   # quiet; refreshes the package lists once if the first try fails
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq "$@" >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "$@" >/dev/null 2>&1; }
}

have_blas=no
for l in /usr/lib/x86_64-linux-gnu/libopenblas.so /usr/lib/aarch64-linux-gnu/libopenblas.so /usr/lib/libopenblas.so /usr/lib64/libopenblas.so; do
  [ -e "$l" ] && have_blas=yes
done
if [ $have_blas = no ]; then
  if can_install; then
    echo "deps: installing libopenblas-dev" >&2
    apt_install libopenblas-dev || echo "deps: could not install libopenblas-dev; building with plain C matmuls (TSYS_NO_CBLAS, slow)" >&2
  else
    echo "deps: no OpenBLAS found and it cannot be installed here; building with plain C matmuls (TSYS_NO_CBLAS, slow)" >&2
  fi
fi

fuzz_ok() {
  printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; return (int)n * 0; }\n' |
    clang -fsanitize=fuzzer,address,undefined -x c - -o /dev/null >/dev/null 2>&1
}
if ! fuzz_ok; then
  if command -v clang >/dev/null; then
    v=$(clang --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n 1)
    pkgs=("libclang-rt-${v:-14}-dev")
  else
    pkgs=(clang libclang-rt-dev)
  fi
  if can_install; then
    echo "deps: installing ${pkgs[*]} (libFuzzer, for the fuzzing stage of make test)" >&2
    apt_install "${pkgs[@]}" || echo "deps: could not install ${pkgs[*]}; make test will skip the fuzzers" >&2
  else
    echo "deps: no clang with libFuzzer here (${pkgs[*]}); make test will skip the fuzzers" >&2
  fi
fi

pkgs=()
command -v cmake >/dev/null || pkgs+=(cmake)
command -v pkg-config >/dev/null || pkgs+=(pkg-config)
if [ ${#pkgs[@]} -gt 0 ]; then
  if can_install; then
    echo "deps: installing ${pkgs[*]} (for tests/test_packaging.sh)" >&2
    apt_install "${pkgs[@]}" || echo "deps: could not install ${pkgs[*]}; test_packaging.sh will skip what needs them" >&2
  else
    echo "deps: no ${pkgs[*]} here; test_packaging.sh will skip what needs them" >&2
  fi
fi
exit 0
