"""Configuration schema and presets: the leaf package every other package may import."""

from configs.app_config import AppConfig, ServeConfig
from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams, StructuredOutputsParams
from configs.sections import CacheConfig, ModelConfig, ParallelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig

__all__ = [
    "AppConfig",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "SamplingParams",
    "SchedulerConfig",
    "ServeConfig",
    "SpeculativeConfig",
    "StructuredOutputsParams",
]
