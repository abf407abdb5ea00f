"""Triton kernels for the paged KV cache: the cache write and the unified (prefill + decode) paged attention.

Importing a kernel module imports triton and decorates the kernels: set TRITON_INTERPRET=1 before that import
to run them on CPU tensors (tests), otherwise they compile for the current GPU on first launch.
"""
