#!/usr/bin/env bash
# test_packaging.sh - tsys as a consumer project sees it: CMakeLists.txt, the installed CMake package
# and the pkg-config files. In a temporary directory, each case builds a small program that defines
# TSYS_IMPLEMENTATION, multiplies two matrices and computes a tiny model's loss, and checks what it
# prints (the product, the loss near ln(vocab), the version, and that CBLAS and OpenMP came with the
# flags: CBLAS wherever the Makefile would find OpenBLAS):
#   subdir      add_subdirectory(<repo>) + target_link_libraries(app tsys::tsys)
#   install     cmake --install to a prefix other than the configured one; the files in place
#   config      find_package(tsys <version> CONFIG REQUIRED) from that prefix; tsys::tsys
#   version     find_package(tsys <next minor>) from that prefix is refused (0.x: minors break)
#   pkgconfig   cc $(pkg-config --cflags --libs tsys), PKG_CONFIG_PATH at the prefix
#   dist        tsys::dist (find_package): two ranks by tsys_dist_spawn all-reduce their rank + 1;
#               with TSYS_DIST_MPI when CMake found MPI
#   dist-pc     the same program with $(pkg-config --cflags --libs tsys-dist)
#   cuda-config where the CUDA toolkit is: find_package(tsys COMPONENTS cuda nccl) defines tsys::cuda
#               with cuBLASLt and cuBLAS (configured only: no CUDA code is compiled)
#   cuda-build  only with PACKAGING_CUDA_BUILD=1 (the kernels take minutes to compile): a CUDA C++
#               consumer linked to tsys::nccl (else tsys::cuda) is built; on a machine with a GPU it
#               runs: a matmul on the GPU equal to the CPU's, and a one-rank NCCL all-reduce. With
#               PACKAGING_CUDA_OUT=DIR the binary is also copied there (to run on a GPU machine).
# Without cmake or pkg-config (tools/deps.sh installs them) their cases are skipped, except under CI
# (CI set), where they fail. Prints one "ok ..." / "FAIL ..." line per case and "N passed, N failed" last.
#
#   tests/test_packaging.sh
set -u
cd "$(dirname "$0")/.."
repo=$(pwd)
tmp=$(mktemp -d /tmp/tsys_packaging_XXXXXX)
trap 'rm -rf "$tmp"' EXIT
# a clean build: nothing inherited from a make that runs this script (-j, its jobserver)
unset MAKEFLAGS MFLAGS MAKELEVEL MAKEOVERRIDES
pass=0; fail=0; skipped=0

why=""
note() { why="$why"$'\n'"      $*"; }
result() {   # NAME: ok / FAIL with the notes gathered since the last result
  if [ -z "$why" ]; then echo "ok   $1"; pass=$((pass + 1)); else echo "FAIL $1$why"; fail=$((fail + 1)); fi
  why=""
}
skip() {     # NAME TOOL: skipped without TOOL, a failure under CI
  if [ -n "${CI:-}" ]; then note "$2 is missing (CI: tools/deps.sh should have installed it)"; result "$1"
  else echo "skip $1 (no $2 here; tools/deps.sh installs it)"; skipped=$((skipped + 1)); fi
}
run() {      # LOG CMD...: runs CMD, its output to LOG; on failure a note with LOG's tail
  local log=$1; shift
  "$@" > "$log" 2>&1 && return 0
  note "'$*' failed:"; while IFS= read -r l; do note "  $l"; done < <(tail -n 15 "$log")
  return 1
}

ver=$(sed -n 's/^#define TSYS_VERSION_\(MAJOR\|MINOR\|PATCH\) \+\([0-9]\+\).*/\2/p' tsys.h | paste -sd.)
next_minor=$(echo "$ver" | awk -F. '{ print $1 "." $2 + 1 }')
# CBLAS is expected wherever the Makefile would link OpenBLAS
blas=no
for l in /usr/lib/x86_64-linux-gnu/libopenblas.so /usr/lib/aarch64-linux-gnu/libopenblas.so /usr/lib/libopenblas.so /usr/lib64/libopenblas.so; do
  [ -e "$l" ] && blas=yes
done

# ---- the consumers
mkdir -p "$tmp/src"
cat > "$tmp/src/app.c" <<'EOF'
#define TSYS_IMPLEMENTATION
#include "tsys.h"
#include <stdio.h>

int main(void) {
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {7, 8, 9, 10, 11, 12}, c[4] = {0};
    int64_t sa[2] = {2, 3}, sb[2] = {3, 2};
    tsys_tensor *A = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 2, sa, a);
    tsys_tensor *B = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 2, sb, b);
    tsys_tensor *C = tsys_matmul(ctx, A, B, false);
    tsys_tensor_to_f32(ctx, C, c);
    printf("matmul %g %g %g %g\n", c[0], c[1], c[2], c[3]);

    tsys_model_desc d = tsys_model_desc_defaults(NULL);
    d.vocab_size = 64; d.d_model = 32; d.num_layers = 1; d.num_heads = 2; d.d_ff = 64; d.context_length = 16;
    tsys_model *m = tsys_model_new(ctx, &d, TSYS_CPU, 1);
    tsys_tensor *ids = tsys_tensor_new_2d(ctx, TSYS_I64, TSYS_CPU, 2, 16);
    tsys_tensor *targets = tsys_tensor_new_2d(ctx, TSYS_I64, TSYS_CPU, 2, 16);
    tsys_tensor_randint(ctx, ids, d.vocab_size); tsys_tensor_randint(ctx, targets, d.vocab_size);
    tsys_tensor *logits = tsys_model_forward(m, ids);
    tsys_tensor *loss = tsys_cross_entropy(ctx, logits, targets);
    float l = 0; tsys_tensor_to_f32(ctx, loss, &l);
    printf("loss %.4f\n", l);
#ifdef TSYS_NO_CBLAS
    printf("cblas no\n");
#else
    printf("cblas yes\n");
#endif
#ifdef _OPENMP
    printf("openmp yes\n");
#else
    printf("openmp no\n");
#endif
    printf("version %d.%d.%d\n", TSYS_VERSION_MAJOR, TSYS_VERSION_MINOR, TSYS_VERSION_PATCH);
    int failed = tsys_ctx_status(ctx) != TSYS_OK;
    if (failed) fprintf(stderr, "error: %s\n", tsys_ctx_last_error(ctx));
    tsys_tensor_release(logits); tsys_tensor_release(loss); tsys_tensor_release(ids); tsys_tensor_release(targets);
    tsys_tensor_release(A); tsys_tensor_release(B); tsys_tensor_release(C);
    tsys_model_free(m); tsys_ctx_free(ctx);
    return failed;
}
EOF
cat > "$tmp/src/dist.c" <<'EOF'
#define TSYS_IMPLEMENTATION
#include "tsys.h"
#define TSYS_DIST_IMPLEMENTATION
#include "tsys_dist.h"
#include <stdio.h>

int main(int argc, char **argv) {
    int code;
    if (tsys_dist_spawn(2, argc, argv, &code)) return code;    // the launcher: two ranks
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    tsys_dist *d = tsys_dist_init(ctx, NULL);
    if (!d) { fprintf(stderr, "error: %s\n", tsys_ctx_last_error(ctx)); return 1; }
    float v = (float)(tsys_dist_rank(d) + 1), sum = 0;
    int64_t shape[1] = {1};
    tsys_tensor *t = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CPU, 1, shape, &v);
    tsys_dist_all_reduce(d, t, TSYS_DIST_SUM);
    tsys_tensor_to_f32(ctx, t, &sum);
    if (tsys_dist_rank(d) == 0)
        printf("allreduce %g size %d engine %s\n", sum, tsys_dist_size(d), tsys_dist_engine_name(tsys_dist_engine_of(d)));
#ifdef TSYS_DIST_MPI
    if (tsys_dist_rank(d) == 0) printf("mpi yes\n");
#endif
    int failed = tsys_ctx_status(ctx) != TSYS_OK;
    if (failed) fprintf(stderr, "error: %s\n", tsys_ctx_last_error(ctx));
    tsys_tensor_release(t); tsys_dist_free(d); tsys_ctx_free(ctx);
    return failed;
}
EOF

# check_app OUT: what app.c prints
check_app() {
  local out=$1 l
  grep -qx 'matmul 58 64 139 154' <<<"$out" || note "wrong product (want 'matmul 58 64 139 154'): $out"
  l=$(sed -n 's/^loss //p' <<<"$out")
  awk -v l="$l" 'BEGIN { exit !(l != "" && l > 3.5 && l < 5) }' || note "loss '$l' is not near ln(64) = 4.16"
  grep -qx "version $ver" <<<"$out" || note "version: want $ver: $out"
  grep -qx "openmp yes" <<<"$out" || note "built without OpenMP (-fopenmp did not come with the flags)"
  if [ $blas = yes ]; then grep -qx "cblas yes" <<<"$out" || note "OpenBLAS is here but the build used plain C loops (TSYS_NO_CBLAS)"; fi
}
# check_dist OUT MPI(yes/no)
check_dist() {
  grep -qx 'allreduce 3 size 2 engine tcp' <<<"$1" || note "want 'allreduce 3 size 2 engine tcp': $1"
  if [ "$2" = yes ]; then grep -qx 'mpi yes' <<<"$1" || note "MPI was found but TSYS_DIST_MPI is not defined"; fi
}
# cmake_app DIR LANG-BODY: a consumer project in DIR whose CMakeLists.txt ends with BODY
cmake_app() {
  mkdir -p "$1"
  { echo 'cmake_minimum_required(VERSION 3.17)'; echo 'project(consumer LANGUAGES C)'; printf '%s\n' "$2"; } > "$1/CMakeLists.txt"
}
# cmake_build DIR [ARGS...]: configure and build DIR into DIR/build
cmake_build() {
  local d=$1; shift
  run "$d/configure.log" cmake -S "$d" -B "$d/build" "$@" && run "$d/build.log" cmake --build "$d/build"
}

have_cmake=$(command -v cmake)
have_pc=$(command -v pkg-config)
prefix=$tmp/prefix

# ---- subdir
if [ -n "$have_cmake" ]; then
  cmake_app "$tmp/subdir" "add_subdirectory(\"$repo\" tsys)
add_executable(app \"$tmp/src/app.c\")
target_link_libraries(app PRIVATE tsys::tsys)"
  cmake_build "$tmp/subdir" && check_app "$(cd "$tmp" && "$tmp/subdir/build/app" 2>&1)"
  result "subdir: add_subdirectory + tsys::tsys"
else skip "subdir: add_subdirectory + tsys::tsys" cmake; fi

# ---- install, config, version, dist
if [ -n "$have_cmake" ]; then
  # configured for one prefix, installed into another: the files must follow --prefix
  run "$tmp/tsys-configure.log" cmake -S "$repo" -B "$tmp/tsys-build" -DCMAKE_INSTALL_PREFIX="$tmp/wrong-prefix" &&
    run "$tmp/tsys-install.log" cmake --install "$tmp/tsys-build" --prefix "$prefix"
  for f in include/tsys.h include/tsys_dist.h include/tsys_cuda.cuh share/cmake/tsys/tsysConfig.cmake \
           share/cmake/tsys/tsysConfigVersion.cmake share/pkgconfig/tsys.pc share/pkgconfig/tsys-dist.pc; do
    [ -f "$prefix/$f" ] || note "not installed: $f"
  done
  grep -qx "prefix=$prefix" "$prefix/share/pkgconfig/tsys.pc" 2>/dev/null || note "tsys.pc: no 'prefix=$prefix'"
  grep -rq "wrong-prefix" "$prefix" && note "the configured prefix leaked into: $(grep -rl wrong-prefix "$prefix")"
  result "install: cmake --install --prefix"

  cmake_app "$tmp/config" "find_package(tsys $ver CONFIG REQUIRED)
add_executable(app \"$tmp/src/app.c\")
target_link_libraries(app PRIVATE tsys::tsys)"
  cmake_build "$tmp/config" -DCMAKE_PREFIX_PATH="$prefix" && check_app "$("$tmp/config/build/app" 2>&1)"
  result "config: find_package(tsys $ver CONFIG) + tsys::tsys"

  cmake_app "$tmp/version" "find_package(tsys $next_minor CONFIG REQUIRED)"
  if cmake -S "$tmp/version" -B "$tmp/version/build" -DCMAKE_PREFIX_PATH="$prefix" > "$tmp/version.log" 2>&1; then
    note "find_package(tsys $next_minor) accepted version $ver"
  elif ! grep -q "tsysConfig.cmake, version: $ver" "$tmp/version.log"; then
    note "refused, but not for its version: $(grep -v '^ *$' "$tmp/version.log" | tail -n 6)"
  fi
  result "version: find_package(tsys $next_minor) is refused"

  cmake_app "$tmp/dist" "find_package(tsys CONFIG REQUIRED COMPONENTS dist)
add_executable(dist \"$tmp/src/dist.c\")
target_link_libraries(dist PRIVATE tsys::dist)
get_target_property(defs tsys::dist INTERFACE_COMPILE_DEFINITIONS)
if(\"TSYS_DIST_MPI\" IN_LIST defs)
  file(WRITE \"\${CMAKE_BINARY_DIR}/mpi\" yes)
else()
  file(WRITE \"\${CMAKE_BINARY_DIR}/mpi\" no)
endif()"
  if cmake_build "$tmp/dist" -DCMAKE_PREFIX_PATH="$prefix"; then
    mpi=$(cat "$tmp/dist/build/mpi")
    check_dist "$("$tmp/dist/build/dist" 2>&1)" "$mpi"
  fi
  result "dist: find_package(tsys COMPONENTS dist) + tsys::dist (MPI: ${mpi:-?})"
else
  for c in install config version dist; do skip "$c" cmake; done
fi

# ---- pkg-config
if [ -n "$have_cmake" ] && [ -n "$have_pc" ] && [ -f "$prefix/share/pkgconfig/tsys.pc" ]; then
  export PKG_CONFIG_PATH=$prefix/share/pkgconfig
  flags=$(pkg-config --cflags --libs tsys 2>"$tmp/pc.err") || note "pkg-config tsys: $(cat "$tmp/pc.err")"
  grep -q -- "-I$prefix/include" <<<"$flags" || note "no -I$prefix/include in: $flags"
  [ "$(pkg-config --modversion tsys 2>/dev/null)" = "$ver" ] || note "pkg-config --modversion tsys: want $ver"
  # shellcheck disable=SC2086
  run "$tmp/pc-build.log" cc -std=c11 -O1 "$tmp/src/app.c" -o "$tmp/app_pc" $flags &&
    check_app "$("$tmp/app_pc" 2>&1)"
  result "pkgconfig: cc \$(pkg-config --cflags --libs tsys)"

  flags=$(pkg-config --cflags --libs tsys-dist 2>"$tmp/pc.err") || note "pkg-config tsys-dist: $(cat "$tmp/pc.err")"
  mpi=no; grep -q -- "-DTSYS_DIST_MPI" <<<"$flags" && mpi=yes
  # shellcheck disable=SC2086
  run "$tmp/pc-dist.log" cc -std=c11 -O1 "$tmp/src/dist.c" -o "$tmp/dist_pc" $flags &&
    check_dist "$("$tmp/dist_pc" 2>&1)" $mpi
  result "dist-pc: cc \$(pkg-config --cflags --libs tsys-dist) (MPI: $mpi)"
elif [ -z "$have_pc" ]; then
  skip "pkgconfig" pkg-config; skip "dist-pc" pkg-config
else
  skip "pkgconfig" cmake; skip "dist-pc" cmake
fi

# ---- CUDA: the target's definition, where the toolkit is (nothing is compiled)
if [ -n "$have_cmake" ] && command -v "${NVCC:-nvcc}" >/dev/null; then
  cmake_app "$tmp/cuda" "find_package(tsys CONFIG REQUIRED COMPONENTS cuda)
get_target_property(libs tsys::cuda INTERFACE_LINK_LIBRARIES)
foreach(want tsys::tsys CUDA::cublasLt CUDA::cublas)
  if(NOT want IN_LIST libs)
    message(FATAL_ERROR \"tsys::cuda does not link \${want}: \${libs}\")
  endif()
endforeach()
if(TARGET tsys::nccl)
  get_target_property(defs tsys::nccl INTERFACE_COMPILE_DEFINITIONS)
  if(NOT \"TSYS_DIST_NCCL\" IN_LIST defs)
    message(FATAL_ERROR \"tsys::nccl without TSYS_DIST_NCCL: \${defs}\")
  endif()
endif()"
  run "$tmp/cuda/configure.log" cmake -S "$tmp/cuda" -B "$tmp/cuda/build" -DCMAKE_PREFIX_PATH="$prefix" \
    -DCUDAToolkit_ROOT="$(dirname "$(dirname "$(command -v "${NVCC:-nvcc}")")")"
  result "cuda-config: find_package(tsys COMPONENTS cuda) defines tsys::cuda"
else
  echo "skip cuda-config (no nvcc here)"
fi

# ---- CUDA: a consumer compiled, linked and (with a GPU) run
cat > "$tmp/src/app_cuda.cu" <<'EOF'
#define TSYS_IMPLEMENTATION
#include "tsys.h"
#define TSYS_CUDA_IMPLEMENTATION
#include "tsys_cuda.cuh"
#ifdef TSYS_DIST_NCCL
#define TSYS_DIST_IMPLEMENTATION
#include "tsys_dist.h"
#endif
#include <stdio.h>

int main(void) {
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) { printf("no gpu\n"); return 0; }
    tsys_ctx *ctx = tsys_ctx_new(NULL);
    if (tsys_cuda_init(ctx, 0) != TSYS_OK) { fprintf(stderr, "error: %s\n", tsys_ctx_last_error(ctx)); return 1; }
    float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {7, 8, 9, 10, 11, 12}, c[4] = {0};
    int64_t sa[2] = {2, 3}, sb[2] = {3, 2};
    tsys_tensor *A = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CUDA, 2, sa, a);
    tsys_tensor *B = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CUDA, 2, sb, b);
    tsys_tensor *C = tsys_matmul(ctx, A, B, false);
    tsys_tensor_to_f32(ctx, C, c);
    printf("cuda matmul %g %g %g %g\n", c[0], c[1], c[2], c[3]);
#ifdef TSYS_DIST_NCCL
    tsys_dist_desc dd;
    memset(&dd, 0, sizeof(dd));
    dd.cuda = true;
    tsys_dist *d = tsys_dist_init(ctx, &dd);
    float v = 3, sum = 0;
    int64_t one[1] = {1};
    tsys_tensor *t = tsys_tensor_from_data(ctx, TSYS_F32, TSYS_CUDA, 1, one, &v);
    if (d) tsys_dist_all_reduce(d, t, TSYS_DIST_SUM);
    tsys_tensor_to_f32(ctx, t, &sum);
    printf("nccl allreduce %g size %d\n", sum, d ? tsys_dist_size(d) : 0);
    tsys_tensor_release(t);
    tsys_dist_free(d);
#endif
    int failed = tsys_ctx_status(ctx) != TSYS_OK;
    if (failed) fprintf(stderr, "error: %s\n", tsys_ctx_last_error(ctx));
    tsys_tensor_release(A); tsys_tensor_release(B); tsys_tensor_release(C);
    tsys_ctx_free(ctx);
    return failed;
}
EOF
if [ "${PACKAGING_CUDA_BUILD:-0}" = 1 ] && [ -n "$have_cmake" ] && command -v "${NVCC:-nvcc}" >/dev/null; then
  cmake_app "$tmp/cudab" "enable_language(CXX)
enable_language(CUDA)
set(CMAKE_CUDA_ARCHITECTURES \"${CUDA_ARCHS:-90a}\")
find_package(tsys CONFIG REQUIRED COMPONENTS cuda)
add_executable(app_cuda \"$tmp/src/app_cuda.cu\")
if(TARGET tsys::nccl)
  target_link_libraries(app_cuda PRIVATE tsys::nccl)
else()
  target_link_libraries(app_cuda PRIVATE tsys::cuda)
endif()"
  cuda_root=$(dirname "$(dirname "$(command -v "${NVCC:-nvcc}")")")
  out=""
  if cmake_build "$tmp/cudab" -DCMAKE_PREFIX_PATH="$prefix" -DCUDAToolkit_ROOT="$cuda_root" -DCMAKE_CUDA_COMPILER="$(command -v "${NVCC:-nvcc}")"; then
    [ -n "${PACKAGING_CUDA_OUT:-}" ] && cp "$tmp/cudab/build/app_cuda" "$PACKAGING_CUDA_OUT/"
    out=$("$tmp/cudab/build/app_cuda" 2>&1)
    if [ "$out" != "no gpu" ]; then
      grep -qx 'cuda matmul 58 64 139 154' <<<"$out" || note "wrong GPU product (want 'cuda matmul 58 64 139 154'): $out"
      if grep -rq TSYS_DIST_NCCL "$tmp/cudab/build/CMakeFiles/app_cuda.dir/" 2>/dev/null; then
        grep -qx 'nccl allreduce 3 size 1' <<<"$out" || note "want 'nccl allreduce 3 size 1': $out"
      fi
    fi
  fi
  result "cuda-build: a CUDA consumer of tsys::cuda / tsys::nccl built${out:+, run: ${out//$'\n'/; }}"
else
  echo "skip cuda-build (PACKAGING_CUDA_BUILD=1 and nvcc turn it on)"
fi

[ $skipped -gt 0 ] && echo "($skipped skipped)"

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
