"""The settings that start vLLM 0.26 with tensor parallelism on a GPU host that keeps NVLink
multicast off, with torch.compile and CUDA graphs on (README, "Tensor parallelism on hosts
without NVLink multicast").

Stock vLLM's default TP start waits in its first forward, where the all-reduce + RMSNorm fusion
pass has FlashInfer JIT-build its multicast all-reduce; the IPC and symmetric-memory all-reduces
are off for the same reason. Shared by ``tests/gpu/test_gpu_parallel.py`` and
``benchmarks/overhead.py --tp``."""

from __future__ import annotations

from typing import Any

GPU_TP_ENV = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
              "VLLM_USE_NCCL_SYMM_MEM": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
"""Environment of the engine's processes (set before the engine starts; workers inherit it).
Workers are spawned: a forked worker fails where its parent has touched CUDA."""

GPU_TP_KWARGS: dict[str, Any] = {
    "disable_custom_all_reduce": True,
    "compilation_config": {"pass_config": {"fuse_allreduce_rms": False, "enable_sp": False,
                                           "fuse_gemm_comms": False}},
}
"""Engine arguments for ``LLM(...)`` beside the parallel sizes."""
