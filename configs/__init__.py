"""Configuration schema and presets: the leaf package every other package may import."""

from configs.app_config import AppConfig
from configs.engine_config import EngineConfig
from configs.sampling_params import SamplingParams

__all__ = ["AppConfig", "EngineConfig", "SamplingParams"]
