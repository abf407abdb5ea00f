"""Building blocks of the models, written for tensor parallelism from the start."""
