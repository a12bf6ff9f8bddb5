#!/usr/bin/env bash
# 1 MB all-reduce latency on every GPU of the host under NCCL settings (NVLS stays off), ours then torch's
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NG=$(nvidia-smi -L | grep -c GPU); nvidia-smi -L | head -1; nvidia-smi topo -m | head -6
run() { echo "== $*"; env "$@" timeout 120 gpu/dist/allreduce_cuda --backend nccl --nproc $NG --sizes 256KB,1MB,4MB --iters 100 --format md 2>&1 | grep "^| all_reduce"; }
run X=default
run NCCL_PROTO=LL
run NCCL_PROTO=LL128
run NCCL_PROTO=Simple
run NCCL_ALGO=Tree
run NCCL_MIN_NCHANNELS=16
run NCCL_MIN_NCHANNELS=32 NCCL_PROTO=LL
run X=default
echo "== torch, defaults"; timeout 200 python3 tests/ref/allreduce_torch.py --backend nccl --nproc $NG --sizes 256KB,1MB,4MB --iters 100 --format md 2>&1 | grep "all_reduce"
echo "== torch, NCCL_PROTO=LL"; NCCL_PROTO=LL timeout 200 python3 tests/ref/allreduce_torch.py --backend nccl --nproc $NG --sizes 256KB,1MB,4MB --iters 100 --format md 2>&1 | grep "all_reduce"
