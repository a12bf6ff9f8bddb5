# tsys - build, test and benchmark.
#   make            CPU drivers (build/e2e, build/precision, build/attn, build/memory, build/allreduce, build/ddp)
#   make test       CPU tests (what CI runs): the tests, the drivers' tests, the same again under
#                   ASan+UBSan (build/asan/), and the libFuzzer harnesses side by side for FUZZ_SECONDS when
#                   clang is present; also compiles the CUDA code when nvcc is present
#   make fuzz       the libFuzzer harnesses only (side by side for FUZZ_SECONDS, default 60)
#   make cuda       CUDA drivers (build/e2e_cuda ...), on a machine with nvcc
#   make test-cuda  CUDA tests (needs a GPU)
#   make bench      ./bench.sh

CC      ?= cc
NVCC    ?= nvcc
BUILD   ?= build
# OpenBLAS: Debian keeps cblas.h under the multiarch include dir, Ubuntu too
# (the header alone is not enough: some machines carry cblas.h from another BLAS without libopenblas)
BLAS_LIBFILE := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libopenblas.so /usr/lib/aarch64-linux-gnu/libopenblas.so /usr/lib/libopenblas.so /usr/lib64/libopenblas.so))
BLAS_INC ?= $(if $(BLAS_LIBFILE),$(firstword $(wildcard /usr/include/x86_64-linux-gnu/cblas.h /usr/include/openblas/cblas.h /usr/include/cblas.h)))
CPPFLAGS += -I. $(if $(BLAS_INC),-I$(dir $(BLAS_INC)),-DTSYS_NO_CBLAS)
BLAS_LIB = $(if $(BLAS_INC),-lopenblas)
# CFLAGS is yours (make CFLAGS=-O0 ...); what the code needs (C11, OpenMP threads, warnings) is in
# TSYS_CFLAGS, which every C compile uses before CFLAGS, so overriding CFLAGS cannot drop it.
CFLAGS  ?= -O2 -march=native
TSYS_CFLAGS = -std=c11 -fopenmp -Wall -Wextra
LDLIBS  += $(BLAS_LIB) -lm
# sm_90a: the FlashAttention kernels use Hopper wgmma (they fall back to mma.sync elsewhere)
CUDA_ARCH ?= -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90
NVFLAGS ?= -O2 -std=c++17 $(CUDA_ARCH) -Xcompiler -fopenmp,-Wall -DTSYS_WITH_CUDA
NVLIBS  = -lcublasLt -lcublas $(BLAS_LIB) -lgomp

HEADERS = tsys.h $(wildcard drivers/*.h)
CPU_DRIVERS = $(BUILD)/e2e $(BUILD)/precision $(BUILD)/attn $(BUILD)/memory $(BUILD)/snapshot
CPU_TESTS = $(BUILD)/test_ops $(BUILD)/test_model $(BUILD)/test_checkpoint $(BUILD)/test_safetensors $(BUILD)/test_flash_cpu $(BUILD)/test_attention $(BUILD)/test_hooks $(BUILD)/test_guards $(BUILD)/test_profiler $(BUILD)/test_state
HAVE_NVCC := $(shell command -v $(NVCC) 2>/dev/null)

# Sanitizer stage: the CPU tests and drivers again with ASan + UBSan (gcc's; OpenMP stays on).
ASAN     = $(BUILD)/asan
SANFLAGS = -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
ASAN_DRIVERS = $(patsubst $(BUILD)/%,$(ASAN)/%,$(CPU_DRIVERS))
ASAN_TESTS = $(patsubst $(BUILD)/%,$(ASAN)/%,$(CPU_TESTS))
# allocator_may_return_null: a huge malloc returns NULL (the out-of-memory paths run) instead of
# aborting; leaks are reported (tests/lsan.supp: none is suppressed today, and why not libgomp whole).
SAN_ENV = ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1:abort_on_error=0 \
          LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp:print_suppressions=0 \
          UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

# libFuzzer harnesses (tests/fuzz/): built with clang when it has the fuzzer runtime.
CLANG   ?= clang
FUZZ    = $(BUILD)/fuzz
FUZZ_SECONDS ?= 60
export FUZZ_SECONDS
# (no -fopenmp: Debian's clang would need libomp; the pragmas are ignored, the code runs on one
# thread. Without it, -std=c11 hides POSIX from tsys.h, hence _POSIX_C_SOURCE here.)
FUZZ_CFLAGS = -std=c11 -D_POSIX_C_SOURCE=200809L -g -O1 -fno-sanitize-recover=undefined -Wall -Wextra -Wno-unknown-pragmas
FUZZ_SAN = address,undefined
HAVE_FUZZ := $(shell printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; return (int)n * 0; }\n' | \
               $(CLANG) -fsanitize=fuzzer -x c - -o /dev/null >/dev/null 2>&1 && echo yes)
FUZZERS = $(FUZZ)/fuzz_safetensors $(FUZZ)/fuzz_flags

# The asynchronous saver's writer thread under ThreadSanitizer: test_state's state_save_async tests, on
# one OpenMP thread (libgomp is not built with TSan: its team's synchronisation would be invisible).
STATE_TSAN = $(BUILD)/tsan-state/test_state
$(STATE_TSAN): tests/test_state.c tests/harness.h tests/test_util.h $(HEADERS) | $(BUILD)
	mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(TSYS_CFLAGS) -O1 -g -fsanitize=thread -fno-omit-frame-pointer -DTS_ONLY='"state_save_async"' $< -o $@ $(LDLIBS)

# Everything run-tests runs; each prints "N passed, N failed" last.
ALL_TESTS = $(CPU_TESTS) $(BUILD)/test_drivers $(BUILD)/test_build $(ASAN_TESTS) $(ASAN)/test_drivers $(STATE_TSAN) $(if $(HAVE_FUZZ),$(FUZZ)/run_fuzzers)
# The README's tour, run as written (tests/test_tour.sh).
TEST_RUNNERS += tests/test_tour.sh
# CMake and pkg-config consumers of the headers (tests/test_packaging.sh).
TEST_RUNNERS += tests/test_packaging.sh
# Training-state snapshots under kill -9 at random moments (tests/test_state_fault.sh, ~20 s).
TEST_RUNNERS += tests/test_state_fault.sh

.PHONY: tsan header-check dist-header-check all test run-tests test-cuda test-dist-cuda cuda cuda-compile bench e2e deps clean asan fuzz fuzz-build fuzz-seeds
HAVE_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo yes)
# No intermediate file is deleted after a build (the CUDA objects of a chain, which make would
# otherwise remove after the test summary, and which a rebuild needs).
.SECONDARY:

all: $(CPU_DRIVERS)

# Fresh machine: install what is missing, then build and test / benchmark (make re-reads this
# file after deps, so the BLAS detection above sees what deps installed).
deps:
	@tools/deps.sh

# The main job: the end-to-end benchmark on the GPU when there is one, else on the CPU.
e2e: deps
ifeq ($(HAVE_GPU)$(if $(HAVE_NVCC),yes),yesyes)
	@$(MAKE) --no-print-directory $(BUILD)/e2e_cuda && $(BUILD)/e2e_cuda --device cuda $(E2E_FLAGS)
else
	@$(MAKE) --no-print-directory $(BUILD)/e2e && $(BUILD)/e2e --device cpu $(E2E_FLAGS)
endif

$(BUILD)/%: drivers/%.c $(HEADERS) | $(BUILD)
	$(CC) $(CPPFLAGS) $(TSYS_CFLAGS) $(CFLAGS) $< -o $@ $(LDLIBS)

$(BUILD)/test_%: tests/test_%.c tests/harness.h tests/test_util.h $(HEADERS) | $(BUILD)
	$(CC) $(CPPFLAGS) $(TSYS_CFLAGS) $(CFLAGS) $< -o $@ $(LDLIBS)

# The driver tests (tests/test_drivers.sh) against one build of the drivers; the build tests
# (tests/test_build.sh) check this Makefile itself.
$(BUILD)/test_drivers: tests/test_drivers.sh $(CPU_DRIVERS) | $(BUILD)
	printf '#!/bin/sh\nexec tests/test_drivers.sh $(BUILD)\n' > $@ && chmod +x $@
$(BUILD)/test_build: tests/test_build.sh | $(BUILD)
	printf '#!/bin/sh\nexec tests/test_build.sh\n' > $@ && chmod +x $@

$(ASAN)/%: drivers/%.c $(HEADERS) | $(ASAN)
	$(CC) $(CPPFLAGS) $(TSYS_CFLAGS) $(SANFLAGS) $< -o $@ $(LDLIBS)
$(ASAN)/test_%: tests/test_%.c tests/harness.h tests/test_util.h $(HEADERS) | $(ASAN)
	$(CC) $(CPPFLAGS) $(TSYS_CFLAGS) $(SANFLAGS) $< -o $@ $(LDLIBS)
$(ASAN)/test_drivers: tests/test_drivers.sh $(ASAN_DRIVERS) | $(ASAN)
	printf '#!/bin/sh\nexec tests/test_drivers.sh $(ASAN)\n' > $@ && chmod +x $@
asan: $(ASAN_TESTS) $(ASAN_DRIVERS) $(ASAN)/test_drivers

# The drivers' flag parsers for fuzz_flags: each driver compiled on its own with main renamed and
# the library private to it (TSYS_STATIC), so the four link into one harness.
$(FUZZ)/driver_%.o: drivers/%.c $(HEADERS) | $(FUZZ)
	$(CLANG) $(CPPFLAGS) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link,$(FUZZ_SAN) -DTSYS_STATIC -Dmain=$*_main -c $< -o $@
$(FUZZ)/fuzz_flags: tests/fuzz/fuzz_flags.c $(FUZZ)/driver_e2e.o $(FUZZ)/driver_attn.o $(FUZZ)/driver_precision.o $(FUZZ)/driver_memory.o | $(FUZZ)
	$(CLANG) $(CPPFLAGS) $(FUZZ_CFLAGS) -fsanitize=fuzzer,$(FUZZ_SAN) $^ -o $@ $(LDLIBS)
$(FUZZ)/fuzz_safetensors: tests/fuzz/fuzz_safetensors.c $(HEADERS) | $(FUZZ)
	$(CLANG) $(CPPFLAGS) $(FUZZ_CFLAGS) -fsanitize=fuzzer,$(FUZZ_SAN) $< -o $@ $(LDLIBS)
# Bounded runs, the fuzzers side by side: new inputs go to build/fuzz/corpus_<name> (the committed
# seeds in tests/fuzz/corpus/<name> stay as they are); a crash lands in build/fuzz/ and fails the
# run: copy it into tests/fuzz/corpus/<name>/ as a regression seed when you fix it.
$(FUZZ)/run_fuzzers: $(FUZZERS) tests/fuzz/run_fuzzer.sh | $(FUZZ)
	printf '#!/bin/sh\nexec tests/fuzz/run_fuzzer.sh $(FUZZ) $(notdir $(FUZZERS))\n' > $@ && chmod +x $@
fuzz-build: $(FUZZ)/run_fuzzers
fuzz: fuzz-build
	@$(FUZZ)/run_fuzzers
# Regenerates the safetensors seeds (tests/fuzz/make_seeds.c writes them with tsys_safetensors_save).
fuzz-seeds: | $(FUZZ)
	$(CC) $(CPPFLAGS) $(TSYS_CFLAGS) $(CFLAGS) tests/fuzz/make_seeds.c -o $(FUZZ)/make_seeds $(LDLIBS)
	$(FUZZ)/make_seeds tests/fuzz/corpus

$(BUILD) $(ASAN) $(FUZZ):
	mkdir -p $@

test: deps
	@$(MAKE) --no-print-directory run-tests

NVCC_HEADER_CHECK = $(NVCC) $(CPPFLAGS) -std=c++17 -Xcompiler -Wall,-Wextra,-Werror -x cu -c $(BUILD)/header_check.c -o $(BUILD)/header_check_cu.o
# The header alone, warning-free as C11 and as C++ (nvcc -x cu includes it in the CUDA build).
header-check: | $(BUILD)
	@printf '#define TSYS_IMPLEMENTATION\n#include "tsys.h"\nint main(void) { return 0; }\n' > $(BUILD)/header_check.c
	$(CC) $(CPPFLAGS) -std=c11 -fopenmp -Wall -Wextra -Wpedantic -Werror -c $(BUILD)/header_check.c -o $(BUILD)/header_check.o
	$(CC) $(CPPFLAGS) -std=c11 -fopenmp -Wall -Wextra -Werror -DTSYS_STATIC -c $(BUILD)/header_check.c -o $(BUILD)/header_check_static.o
	$(if $(HAVE_NVCC),$(NVCC_HEADER_CHECK))

# The tour runs the drivers `make` builds.
run-tests: all
# Runs every test program; the last line is the sum over all of them.
run-tests: header-check $(ALL_TESTS) $(if $(HAVE_NVCC),cuda-compile)
	@pass=0; fail=0; for t in $(ALL_TESTS) $(TEST_RUNNERS); do \
	  log=$$(case $$t in $(BUILD)/*) echo $$t.log;; *) echo $(BUILD)/$$(basename $$t).log;; esac); \
	  echo "== $$t"; $(SAN_ENV) $$t > $$log 2>&1; rc=$$?; cat $$log; \
	  line=$$(tail -n 1 $$log); \
	  p=$$(echo "$$line" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$$/\1/p'); \
	  f=$$(echo "$$line" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$$/\2/p'); \
	  if [ -z "$$p" ]; then p=0; f=$$((f+1)); echo "$$t did not finish (exit $$rc)"; \
	  elif [ $$rc -ne 0 ] && [ "$$f" -eq 0 ]; then f=1; echo "$$t exited $$rc after its summary (a sanitizer report?)"; fi; \
	  pass=$$((pass+p)); fail=$$((fail+f)); done; \
	$(if $(HAVE_FUZZ),,echo "(no clang with libFuzzer here: the fuzzers were not run)";) \
	echo "$$pass passed, $$fail failed"; [ $$fail -eq 0 ]

# CUDA builds (nvcc compiles the same driver sources as CUDA C++).
CUDA_DRIVERS = $(BUILD)/e2e_cuda $(BUILD)/attn_cuda $(BUILD)/memory_cuda
# the kernel lab (dev/flash_lab.cu, public API only) is built beside the tests and its checks run with them
CUDA_TESTS = $(BUILD)/test_cuda $(BUILD)/flash_lab
# The drivers link one compiled copy of both implementations (the kernels take minutes to compile);
# the test programs, which reach into the implementations, compile their own.
$(BUILD)/tsys_impl_cuda.o: tsys.h tsys_cuda.cuh | $(BUILD)
	@printf '#define TSYS_IMPLEMENTATION\n#include "tsys.h"\n#define TSYS_CUDA_IMPLEMENTATION\n#include "tsys_cuda.cuh"\n' > $(BUILD)/tsys_impl_cuda.cu
	$(NVCC) $(NVFLAGS) $(CPPFLAGS) -c $(BUILD)/tsys_impl_cuda.cu -o $@
$(BUILD)/%_cuda.o: drivers/%.c $(HEADERS) tsys_cuda.cuh | $(BUILD)
	$(NVCC) $(NVFLAGS) $(CPPFLAGS) -DTSYS_LINKED_IMPL -x cu -c $< -o $@
$(BUILD)/%_cuda: $(BUILD)/%_cuda.o $(BUILD)/tsys_impl_cuda.o
	$(NVCC) $(NVFLAGS) $^ -o $@ $(NVLIBS)
$(BUILD)/flash_lab: dev/flash_lab.cu $(HEADERS) tsys_cuda.cuh | $(BUILD)
	$(NVCC) $(NVFLAGS) $(CPPFLAGS) $< -o $@ $(NVLIBS)
$(BUILD)/test_cuda: tests/test_cuda.cu tests/harness.h tests/test_util.h $(HEADERS) tsys_cuda.cuh | $(BUILD)
	$(NVCC) $(NVFLAGS) $(CPPFLAGS) $< -o $@ $(NVLIBS)

cuda: $(CUDA_DRIVERS) $(CUDA_TESTS)

# CI has nvcc but no GPU: compile and link the drivers and the CUDA tests (which instantiate every
# kernel) so broken kernels cannot land; the kernel lab is left to the GPU machine's `make cuda`.
cuda-compile: $(CUDA_DRIVERS) $(BUILD)/test_cuda $(BUILD)/tsys_impl_cuda_noflash.o
# The CUDA backend without its FlashAttention section (TSYS_CUDA_NO_FLASH), for users who want a fast build.
$(BUILD)/tsys_impl_cuda_noflash.o: $(BUILD)/tsys_impl_cuda.o
	$(NVCC) $(NVFLAGS) $(CPPFLAGS) -DTSYS_CUDA_NO_FLASH -c $(BUILD)/tsys_impl_cuda.cu -o $@

test-cuda: $(CUDA_TESTS)
	$(BUILD)/test_cuda
	$(BUILD)/flash_lab test

# ---- distributed: tsys_dist.h -------------------------------------------------------------------
# CPU ranks through MPI when Open MPI's mpicc is there (its flags, our compiler and CFLAGS), else the
# tcp engine alone (shared memory / TCP, launched by --nproc). drivers/ddp.c and tests/test_ddp.c
# plug in by existing. tests/run_dist.sh runs every DIST_TESTS program under mpirun -np 2 and -np 4
# (the launcher without MPI), plus test_dist alone, through the launcher and its failure modes, and
# tests/test_netns.sh: the same programs across two simulated hosts (network namespaces, needs root).
MPICC ?= mpicc
MPI_COMPILE := $(shell $(MPICC) --showme:compile 2>/dev/null)
MPI_LINK := $(shell $(MPICC) --showme:link 2>/dev/null)
HAVE_MPI := $(if $(MPI_COMPILE),yes)
DIST_CFLAGS = -D_GNU_SOURCE -pthread $(if $(HAVE_MPI),-DTSYS_DIST_MPI $(MPI_COMPILE))
DIST_LIBS = -pthread $(if $(HAVE_MPI),$(MPI_LINK))
DIST_HEADERS = tsys_dist.h tests/harness_dist.h
DIST_DRIVERS = $(BUILD)/allreduce $(if $(wildcard drivers/ddp.c),$(BUILD)/ddp) $(if $(wildcard drivers/mesh.c),$(BUILD)/mesh)
DIST_TESTS = $(BUILD)/test_dist $(BUILD)/test_mesh $(if $(wildcard tests/test_ddp.c),$(BUILD)/test_ddp) $(if $(wildcard tests/test_fsdp.c),$(BUILD)/test_fsdp)
# tests that start their own ranks (run once, alone)
DIST_SOLO_TESTS = $(BUILD)/test_rendezvous
TEST_RUNNERS += tests/run_dist.sh
# every driver, the distributed ones too, through the same contract cases
TEST_RUNNERS += tests/test_contract.sh

$(DIST_DRIVERS): $(BUILD)/%: drivers/%.c $(HEADERS) $(DIST_HEADERS) | $(BUILD)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(DIST_CFLAGS) $< -o $@ $(DIST_LIBS) $(LDLIBS)
$(DIST_TESTS) $(DIST_SOLO_TESTS): $(BUILD)/%: tests/%.c tests/harness.h tests/test_util.h tests/state_dist.h $(HEADERS) $(DIST_HEADERS) | $(BUILD)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(DIST_CFLAGS) $< -o $@ $(DIST_LIBS) $(LDLIBS)
all: $(DIST_DRIVERS)
# tsys_dist.h alone, warning-free as C11 (with and without MPI) and as C++
dist-header-check: | $(BUILD)
	@printf '#define TSYS_IMPLEMENTATION\n#include "tsys.h"\n#define TSYS_DIST_IMPLEMENTATION\n#include "tsys_dist.h"\nint main(void) { return 0; }\n' > $(BUILD)/dist_header_check.c
	$(CC) $(CPPFLAGS) -std=c11 -fopenmp -D_GNU_SOURCE -Wall -Wextra -Wpedantic -Werror -c $(BUILD)/dist_header_check.c -o $(BUILD)/dist_header_check.o
	$(if $(HAVE_MPI),$(CC) $(CPPFLAGS) -std=c11 -fopenmp -D_GNU_SOURCE -Wall -Wextra -Wpedantic -Werror -DTSYS_DIST_MPI $(MPI_COMPILE) -c $(BUILD)/dist_header_check.c -o $(BUILD)/dist_header_check_mpi.o)
	$(CXX) $(CPPFLAGS) -x c++ -std=c++17 -fopenmp -Wall -Wextra -Werror $(if $(HAVE_MPI),-DTSYS_DIST_MPI $(MPI_COMPILE)) -c $(BUILD)/dist_header_check.c -o $(BUILD)/dist_header_check_cxx.o
# The same tests under ThreadSanitizer (the worker thread that runs asynchronous host collectives
# beside the caller's: tests/tsan.supp lists what is suppressed inside Open MPI, nothing of ours).
TSAN = $(BUILD)/tsan
TSAN_FLAGS = -O1 -g -fsanitize=thread -fno-omit-frame-pointer
DIST_TSAN_TESTS = $(DIST_TESTS:$(BUILD)/%=$(TSAN)/%)
$(DIST_TSAN_TESTS): $(TSAN)/%: tests/%.c tests/harness.h tests/test_util.h tests/state_dist.h $(HEADERS) $(DIST_HEADERS) | $(TSAN)
	$(CC) $(CPPFLAGS) $(TSAN_FLAGS) $(DIST_CFLAGS) $< -o $@ $(DIST_LIBS) $(LDLIBS)
$(TSAN):
	mkdir -p $@
tsan: $(DIST_TSAN_TESTS)
run-tests: dist-header-check $(DIST_TESTS) $(DIST_SOLO_TESTS) $(DIST_TSAN_TESTS)
run-tests: export TSYS_DIST_TESTS = $(DIST_TESTS)
run-tests: export TSYS_DIST_TSAN_TESTS = $(DIST_TSAN_TESTS)
run-tests: export BUILD := $(BUILD)

# CUDA: NCCL for CUDA tensors, MPI for the rest; linked against the one compiled implementation.
NCCL_LIBS = -lnccl
DIST_NVFLAGS = -DTSYS_DIST_NCCL -D_GNU_SOURCE $(if $(HAVE_MPI),-DTSYS_DIST_MPI $(MPI_COMPILE))
DIST_CUDA = $(DIST_DRIVERS:%=%_cuda) $(DIST_TESTS:%=%_cuda)
$(DIST_DRIVERS:%=%_cuda.o): $(BUILD)/%_cuda.o: drivers/%.c $(HEADERS) $(DIST_HEADERS) tsys_cuda.cuh | $(BUILD)
	$(NVCC) $(NVFLAGS) $(CPPFLAGS) $(DIST_NVFLAGS) -DTSYS_LINKED_IMPL -x cu -c $< -o $@
$(DIST_TESTS:%=%_cuda.o): $(BUILD)/%_cuda.o: tests/%.c tests/harness.h tests/test_util.h tests/state_dist.h $(HEADERS) $(DIST_HEADERS) tsys_cuda.cuh | $(BUILD)
	$(NVCC) $(NVFLAGS) $(CPPFLAGS) $(DIST_NVFLAGS) -DTSYS_LINKED_IMPL -x cu -c $< -o $@
$(DIST_CUDA): %: %.o $(BUILD)/tsys_impl_cuda.o
	$(NVCC) $(NVFLAGS) $^ -o $@ $(NVLIBS) $(NCCL_LIBS) $(if $(HAVE_MPI),$(MPI_LINK))
# the lab tool that times NCCL alone beside tsys_dist (dev/nccl_latency.c: MPI ranks, one GPU each)
$(BUILD)/nccl_latency: dev/nccl_latency.c | $(BUILD)
	$(NVCC) $(NVFLAGS) $(MPI_COMPILE) -x cu $< -o $@ $(NCCL_LIBS) $(MPI_LINK)
# the lab tool that all-reduces on the copy engines between MPI ranks (dev/ce_lab.cu), beside NCCL
$(BUILD)/ce_lab: dev/ce_lab.cu | $(BUILD)
	$(NVCC) $(NVFLAGS) $(MPI_COMPILE) $< -o $@ -lcublas $(NCCL_LIBS) $(MPI_LINK)
cuda: $(DIST_CUDA) $(if $(HAVE_MPI),$(BUILD)/nccl_latency $(BUILD)/ce_lab)
cuda-compile: $(DIST_CUDA) $(if $(HAVE_MPI),$(BUILD)/nccl_latency $(BUILD)/ce_lab)
# On the GPU machine: NCCL in a group of one, then two ranks sharing the GPU through host staging.
test-cuda: test-dist-cuda
test-dist-cuda: $(BUILD)/test_dist_cuda
	$(BUILD)/test_dist_cuda
	$(if $(HAVE_MPI),OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 2 $(BUILD)/test_dist_cuda,$(BUILD)/test_dist_cuda --nproc 2)

bench: all
	./bench.sh

clean:
	rm -rf $(BUILD)
