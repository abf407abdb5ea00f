"""The YAML schema and presets users deploy with."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs.app_config import AppConfig

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
    assert AppConfig.model_validate(application["args"]).serve.app_name == application["name"]


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
