"""The YAML schema and presets users deploy with."""

from __future__ import annotations

import itertools
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from configs.app_config import AppConfig, ServeConfig
from configs.engine_config import EngineConfig
from configs.sections import CacheConfig, RuntimeConfig

SERVE_CONFIG = Path("configs/serve.yaml")
PRESETS = sorted(path for path in Path("configs").glob("*.yaml") if path != SERVE_CONFIG)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda path: path.name)
def test_every_preset_loads(preset):
    config = AppConfig.from_yaml(preset)
    engine = config.engine_config()
    assert engine.world_size == config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size


def test_default_preset_is_what_make_serve_promises():
    config = AppConfig.from_yaml("default")
    assert config.engine_config().model_name == "smollm2-135m-instruct"
    assert (config.serve.host, config.serve.port) == ("127.0.0.1", 8000)
    assert config.engine_config().world_size == 1


def test_tp3_preset_splits_smollm2_three_ways():
    config = AppConfig.from_yaml("smollm2-tp3")
    assert config.parallel.tensor_parallel_size == 3
    # Other ranks learn sampled tokens from the plans: async scheduling is off there by default.
    assert not config.engine_config().uses_async_scheduling()
    assert AppConfig.from_yaml("default").engine_config().uses_async_scheduling()


def test_async_scheduling_with_tensor_parallelism_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler:\n  async_scheduling: true\nparallel:\n  tensor_parallel_size: 2\n")
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size"):
        AppConfig.from_yaml(bad).engine_config()
    bad.write_text("scheduler:\n  async_scheduling: false\n")
    assert not AppConfig.from_yaml(bad).engine_config().uses_async_scheduling()
    bad.write_text("scheduler:\n  async_scheduling: true\n")
    assert AppConfig.from_yaml(bad).engine_config().uses_async_scheduling()


def test_direct_ingress_is_refused_with_more_than_one_ingress_replica_or_a_foreign_ray(tmp_path, monkeypatch):
    from cluster.serve import direct_ingress_env, start_ray

    bad = tmp_path / "bad.yaml"
    bad.write_text("serve:\n  direct_ingress: true\n  ingress_replicas: 2\n")
    with pytest.raises(ValueError, match="one ingress replica"):
        AppConfig.from_yaml(bad)
    bad.write_text("serve:\n  direct_ingress: true\n  port: 9100\n")
    config = AppConfig.from_yaml(bad)
    env = direct_ingress_env(config)
    # Serve hands replica ports out of [min, max): exactly the configured one.
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == (
        "9100",
        "9101",
    )
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    with pytest.raises(ValueError, match="RAY_SERVE_ENABLE_DIRECT_INGRESS=1"):
        start_ray(config)


def test_direct_ingress_by_default_only_where_it_applies(tmp_path):
    """Unset, direct ingress is on for a Ray that `pagedserve serve` starts with one ingress replica, and off when
    joining a Ray started elsewhere or with more replicas (no error there); an explicit value always wins."""
    path = tmp_path / "config.yaml"
    path.write_text("serve:\n  port: 9100\n")
    unset = AppConfig.from_yaml(path).serve
    assert unset.direct_ingress is None
    assert unset.uses_direct_ingress(owns_ray=True) and not unset.uses_direct_ingress(owns_ray=False)
    path.write_text("serve:\n  ingress_replicas: 2\n")
    assert not AppConfig.from_yaml(path).serve.uses_direct_ingress(owns_ray=True)
    path.write_text("serve:\n  port: 65535\n")
    assert not AppConfig.from_yaml(path).serve.uses_direct_ingress(owns_ray=True)
    path.write_text("serve:\n  direct_ingress: false\n")
    assert not AppConfig.from_yaml(path).serve.uses_direct_ingress(owns_ray=True)
    assert AppConfig.from_yaml("default").serve.uses_direct_ingress(owns_ray=True)


def test_unknown_key_is_rejected_with_its_name(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  blok_size: 32\n")
    with pytest.raises(ValueError, match="blok_size"):
        AppConfig.from_yaml(bad)
    bad.write_text("servee:\n  port: 1\n")
    with pytest.raises(ValueError, match="servee"):
        AppConfig.from_yaml(bad)


def test_invalid_value_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel:\n  tensor_parallel_size: 0\n")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        AppConfig.from_yaml(bad)


def test_serve_config_file_carries_an_app_config():
    import yaml

    serve_config = yaml.safe_load(SERVE_CONFIG.read_text())
    (application,) = serve_config["applications"]
    assert application["import_path"] == "serve_app.app:build_app"
    # The app takes its name and route from Serve: the args neither need nor repeat them.
    assert not {"app_name", "route_prefix"} & set(application["args"].get("serve", {}))
    assert AppConfig.from_serve_args(application["args"]).model.name == "smollm2-135m-instruct"


def test_embedded_ray_runs_serve_control_loop_every_half_second_unless_told(tmp_path, monkeypatch):
    """A Ray that `pagedserve serve` starts gets Serve's control loop at 0.5 s (Serve's 0.1 s costs 3% of a core,
    idle); a value in the environment wins; direct ingress adds its own settings."""
    from cluster.serve import embedded_ray_env

    path = tmp_path / "config.yaml"
    path.write_text("serve:\n  port: 9100\n")
    config = AppConfig.from_yaml(path)
    monkeypatch.delenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", raising=False)
    assert embedded_ray_env(config, direct_ingress=False) == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.2")
    env = embedded_ray_env(config, direct_ingress=True)
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.2"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "9100"


def schema_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every leaf key of a config model as `section.key`, nested sections (speculative_config) spelled out."""
    keys = []
    for name, field in model.model_fields.items():
        nested = [arg for arg in (field.annotation, *typing.get_args(field.annotation)) if _is_section(arg)]
        if nested:
            keys += schema_keys(nested[0], f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _is_section(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def test_every_field_is_declared_once_across_the_sections():
    from configs.engine_config import ENGINE_SECTIONS

    sections = {**ENGINE_SECTIONS, "serve": ServeConfig}
    # Besides the sections, only `models`: a list of entries made of the same sections.
    assert list(AppConfig.model_fields) == [*sections, "models"]
    names = [name for section in sections.values() for name in section.model_fields]
    assert len(names) == len(set(names)), sorted(name for name in names if names.count(name) > 1)


def test_flat_keyword_arguments_land_in_their_sections():
    config = EngineConfig(model="some/dir", block_size=32, max_num_seqs=8, tensor_parallel_size=2, transport="ray")
    assert (config.model.name, config.cache.block_size, config.scheduler.max_num_seqs) == ("some/dir", 32, 8)
    assert (config.parallel.tensor_parallel_size, config.runtime.transport, config.world_size) == (2, "ray", 2)
    # Flat keys merge into a nested section given beside them; nested and flat build the same config.
    assert EngineConfig(cache={"num_kv_blocks": 64}, block_size=8).cache == CacheConfig(num_kv_blocks=64, block_size=8)
    assert EngineConfig(cache={"block_size": 32}, model={"name": "some/dir"}) == EngineConfig(
        model="some/dir", block_size=32
    )
    with pytest.raises(ValueError, match="blok_size"):
        EngineConfig(blok_size=32)


def test_kv_cache_dtype_takes_auto_and_refuses_fp8_by_its_vllm_name():
    assert EngineConfig(model="some/dir", kv_cache_dtype="auto").cache.kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="some/dir", kv_cache_dtype="fp8")


def test_environment_variables_set_defaults_and_the_config_wins(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setenv("PAGEDSERVE_KEEP_FREED_MEMORY", "0")
    assert (RuntimeConfig().cpu_kernels, RuntimeConfig().keep_freed_memory) == ("off", False)
    assert EngineConfig(cpu_kernels="on", keep_freed_memory=True).runtime.cpu_kernels == "on"
    monkeypatch.delenv("PAGEDSERVE_DISABLE_CPU_KERNELS")
    monkeypatch.delenv("PAGEDSERVE_KEEP_FREED_MEMORY")
    assert (RuntimeConfig().cpu_kernels, RuntimeConfig().keep_freed_memory) == ("auto", True)


def test_the_served_engine_runs_on_ray_workers_with_the_apps_sections():
    config = AppConfig.from_yaml("default", max_num_seqs=7)
    engine = config.engine_config()
    assert type(engine) is EngineConfig and engine.parallel.distributed_executor == "ray"
    assert engine.scheduler == config.scheduler and engine.scheduler.max_num_seqs == 7


README_CONFIGS_HEADER = "| key | default | flag | vLLM's flag | meaning |"


def test_the_configuration_doc_table_lists_exactly_the_schema_keys():
    document = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    lines = document.split("\n## Configs", 1)[1].split("\n## ", 1)[0].splitlines()
    # The one table of keys (tests/test_cli.py checks its flag columns against the parser).
    assert README_CONFIGS_HEADER in lines
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[lines.index(README_CONFIGS_HEADER) + 2 :])
    documented = [row.strip("|").split(" | ")[0].strip() for row in rows]
    assert documented == [f"`{key}`" for key in schema_keys(AppConfig)]
