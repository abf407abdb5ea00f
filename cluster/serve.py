"""`pagedserve serve`: attach to RAY_ADDRESS or start an embedded Ray, deploy the app, serve until Ctrl-C."""

from __future__ import annotations

import logging
import os
import signal
import threading

from configs.app_config import AppConfig

logger = logging.getLogger(__name__)


def embedded_ray_num_cpus(config: AppConfig) -> int:
    """Logical CPUs for an embedded Ray: enough for every worker bundle and the ingress on a small box."""
    needed = config.parallel.worker_num_cpus * config.parallel.tensor_parallel_size
    needed *= config.parallel.pipeline_parallel_size
    needed += config.serve.ingress_num_cpus * config.serve.ingress_replicas
    return max(int(needed) + 2, os.cpu_count() or 1)


def start_ray(config: AppConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("attaching to the Ray cluster at %s", address)
        ray.init(address=address)
    else:
        # Ray resources are logical: an embedded Ray gets enough CPUs for every worker; torch threads are set apart.
        ray.init(num_cpus=embedded_ray_num_cpus(config), include_dashboard=False)


def deploy(config: AppConfig, blocking: bool = False) -> str:
    """Deploy (or update) the application; returns the OpenAI base URL once it answers."""
    from ray import serve

    from serve_app.app import build_app

    start_ray(config)
    serve.start(http_options={"host": config.serve.host, "port": config.serve.port})
    serve.run(build_app(config), name=config.serve.app_name, route_prefix=config.serve.route_prefix, blocking=False)
    host = "127.0.0.1" if config.serve.host in ("0.0.0.0", "::") else config.serve.host
    prefix = config.serve.route_prefix.rstrip("/")
    url = f"http://{host}:{config.serve.port}{prefix}/v1"
    logger.info("pagedserve is ready: %s (model %s)", url, config.engine_config().model_name)
    return url


def serve_forever(config: AppConfig) -> None:
    import ray
    from ray import serve

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        deploy(config)
        stop.wait()
    finally:
        logger.info("shutting down Serve and Ray")
        serve.shutdown()
        ray.shutdown()
