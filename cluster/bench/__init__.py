"""Benchmarking: the HTTP serving benchmark (`pagedserve bench`), the offline `LLM` harness (`bench-offline`),
reference baselines (HF generate, our linears alone) and the leak soak (`pagedserve soak`)."""
