"""Cluster operations: the `pagedserve` CLI, the embedded-Ray server, `ray job submit` jobs, and benchmarks
(`cluster.bench`)."""
