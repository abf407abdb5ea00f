"""`BenchConfig`: the settings of `pagedserve bench`, shared by the HTTP client, the benchmark and the soak."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal


@dataclass
class BenchConfig:
    """Benchmark settings; the CLI flags of `pagedserve bench` map one to one onto these fields."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first id from GET {base_url}/models
    endpoint: Literal["completions", "chat"] = "completions"
    num_prompts: int = 64
    input_len: int = 48  # random words per prompt, after the shared prefix if any
    output_len: int = 64  # max_tokens, sent with ignore_eos so every request generates exactly this many
    # Each request's max_tokens drawn from [output_len*(1-r), output_len*(1+r)] as vllm's --random-range-ratio does.
    random_range_ratio: float = 0.0
    temperature: float = 0.0  # sent in every request; 0 is greedy
    request_rate: float = math.inf  # inf: all requests at once; else Poisson arrivals at this rate (req/s)
    max_concurrency: int | None = None  # None: unlimited in-flight requests
    shared_prefix_words: int = 0  # every prompt starts with the same N-word prefix (prefix-cache measurements)
    seed: int = 0
    output_json: str | None = None
    api_key: str | None = None
    timeout: float = 600.0  # seconds a single request may take in total before it counts as failed
    warmup: bool = True  # one untimed request first; the benchmark aborts if it fails
    disable_tqdm: bool = False
    # After the HTTP run: HF generate and the matmul roofline on the same prompts, in this process.
    baselines: bool = False
    model_dir: str | None = None  # the served model's HF directory; None: resolve the served id if it is an alias
    hf_batch_sizes: tuple[int, ...] = (8, 16, 32)  # static batch sizes tried for HF generate (a "8,16" string works)
    roofline_iterations: int = 20  # timed linear-only decode steps per batch size (median taken)
    # The baselines' precision, the one the server serves; auto: as the engine resolves it (`resolve_auto_dtype`).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"

    def __post_init__(self) -> None:
        self.hf_batch_sizes = parse_batch_sizes(self.hf_batch_sizes)

    @classmethod
    def from_any(cls, args: BenchConfig | argparse.Namespace | dict[str, Any]) -> BenchConfig:
        """Accepts a BenchConfig, an argparse Namespace or a dict; unknown attributes are ignored."""
        if isinstance(args, BenchConfig):
            return args
        values = args if isinstance(args, dict) else vars(args)
        names = {config_field.name for config_field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in values.items() if name in names})

    def validate(self) -> None:
        """Raises ValueError on settings no run can use."""
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.num_prompts < 1 or self.output_len < 1 or self.input_len < 0 or self.shared_prefix_words < 0:
            raise ValueError("num_prompts and output_len must be >= 1; input_len and shared_prefix_words >= 0")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive or inf, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {self.max_concurrency}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.baselines and self.roofline_iterations < 1:
            raise ValueError(f"roofline_iterations must be >= 1, got {self.roofline_iterations}")


def parse_batch_sizes(value: str | Sequence[int]) -> tuple[int, ...]:
    """ "8,16,32" (or a sequence of ints) -> (8, 16, 32); raises ValueError unless every size is an int >= 1."""
    parts = [part for part in value.split(",") if part.strip()] if isinstance(value, str) else list(value)
    try:
        sizes = tuple(int(part) for part in parts)
    except (TypeError, ValueError):
        raise ValueError(f"batch sizes must be comma-separated integers, got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch sizes must be one or more integers >= 1, got {value!r}")
    return sizes
