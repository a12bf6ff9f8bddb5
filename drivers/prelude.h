// prelude.h - the one way a tsys program (a driver, a test) takes in the headers: tsys.h, and
// tsys_cuda.cuh when built with nvcc (TSYS_WITH_CUDA), and tsys_dist.h when TSYS_PRELUDE_DIST is
// defined first. The implementations are compiled into the program, unless its build links the one
// compiled copy the Makefile makes (TSYS_LINKED_IMPL: the CUDA kernels take minutes to compile,
// once is enough; TSYS_DIST_LINKED_IMPL likewise for tsys_dist.h).
//
//   #define TSYS_PRELUDE_DIST        (optional)
//   #include "../drivers/prelude.h"
#ifndef TSYS_PRELUDE_H
#define TSYS_PRELUDE_H
#ifndef TSYS_LINKED_IMPL
#define TSYS_IMPLEMENTATION
#endif
#include "../tsys.h"
#ifdef TSYS_WITH_CUDA
#ifndef TSYS_LINKED_IMPL
#define TSYS_CUDA_IMPLEMENTATION
#endif
#include "../tsys_cuda.cuh"
#endif
#ifdef TSYS_PRELUDE_DIST
#ifndef TSYS_DIST_LINKED_IMPL
#define TSYS_DIST_IMPLEMENTATION
#endif
#include "../tsys_dist.h"
#endif
#endif
