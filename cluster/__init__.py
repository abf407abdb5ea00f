"""Entry points: the `pagedserve` CLI and (next) Ray cluster jobs."""
