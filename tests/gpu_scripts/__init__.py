"""Scripts the GPU tests and benchmarks run in subprocesses (one vLLM engine per process)."""
