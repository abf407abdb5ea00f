"""`pagedserve serve`: attach to RAY_ADDRESS or start an embedded Ray, deploy the app, serve until SIGINT/SIGTERM.

Shutdown is graceful: new requests get 503 at once, the ones in flight finish within a grace period (a second
signal cuts it short), then the application is deleted and, for an embedded Ray, Serve and Ray are stopped.
A signal during start-up (Ray starting, the model loading, Serve deploying) has nothing to drain: it stops at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from configs.app_config import AppConfig
from executor.executors import embedded_ray_num_cpus
from model_executor.hub import hub_environment

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0
# How often `serve_forever` checks that the application still exists (`serve shutdown` from elsewhere).
APP_CHECK_PERIOD_S = 5.0
RAY_CALL_TIMEOUT_S = 30.0
# How long an interrupted start-up asks the engines whether they already took requests.
IN_FLIGHT_CHECK_S = 1.0


def direct_ingress_env(config: AppConfig) -> dict[str, str]:
    """Ray Serve's settings that make the ingress replica serve HTTP on serve.port itself.

    Serve reads them when its processes start, so they go into the environment of the Ray that this process starts.
    """
    port = config.serve.port
    return {
        # Ray's throughput bundle: direct ingress, user code and router on the replica's loop, GC frozen at start.
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        # Serve allocates replica ports from [min, max): exactly serve.port.
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        # The bundle sends replica logs to files only; a user of `pagedserve serve` reads them on the console.
        "RAY_SERVE_LOG_TO_STDERR": "1",
        # A freed port waits out a quarantine meant for HAProxy; with none in front, a replacement replica takes it.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        # Our own drain finishes the requests in flight before the app is deleted: no extra wait on top.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    }


def embedded_ray_env(config: AppConfig, direct_ingress: bool) -> dict[str, str]:
    """Settings for the processes of a Ray that `pagedserve serve` starts.

    Serve's control loop runs every 0.5 s unless the environment says otherwise: its idle polling costs CPU the
    model's threads need on a small machine; health checks and autoscaling react within 0.5 s instead of 0.1 s.
    """
    env = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": os.environ.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")}
    if direct_ingress:
        env.update(direct_ingress_env(config))
    return env


def start_ray(config: AppConfig) -> bool:
    """Connect to RAY_ADDRESS or start an embedded Ray; True when this process started (and so owns) Ray."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    started_elsewhere = ray.is_initialized() or bool(address)
    direct_ingress = config.serve.uses_direct_ingress(owns_ray=not started_elsewhere)
    if direct_ingress and started_elsewhere and os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1":
        raise ValueError(
            "serve.direct_ingress applies to the Ray that `pagedserve serve` starts; for a Ray started "
            "elsewhere, start it with RAY_SERVE_ENABLE_DIRECT_INGRESS=1 instead"
        )
    if ray.is_initialized():
        return False
    if address:
        logger.info("attaching to the Ray cluster at %s", address)
        # The job's actors (ingress, scheduler) run on nodes with their own environment: the hub settings travel.
        hub_env = hub_environment()
        ray.init(address=address, runtime_env={"env_vars": hub_env} if hub_env else None)
        return False
    os.environ.update(embedded_ray_env(config, direct_ingress))
    logger.info("starting a Ray of its own")
    if direct_ingress:
        logger.info(
            "direct ingress: the ingress replica serves port %d, Serve's proxy port %d",
            config.serve.port,
            config.serve.port + 1,
        )
    # Ray resources are logical: an embedded Ray gets enough CPUs for every worker; torch threads are set apart.
    from serve_app.engines import max_engine_replicas

    ingress_cpus = config.serve.ingress_num_cpus * config.serve.ingress_replicas
    # Every model's engines at their most, beyond the one engine embedded_ray_num_cpus counts itself.
    engine_cpus = sum(
        app.parallel.worker_num_cpus * app.parallel.world_size * max_engine_replicas(app) for app in config.model_apps()
    )
    other_cpus = ingress_cpus + engine_cpus - config.parallel.worker_num_cpus * config.parallel.world_size
    ray.init(num_cpus=embedded_ray_num_cpus(config.parallel, other_cpus), include_dashboard=False)
    return True


def deploy(config: AppConfig, blocking: bool = False) -> str:
    """Deploy (or update) the application; returns the OpenAI base URL once it answers."""
    from ray import serve

    from serve_app.app import build_app

    start_ray(config)
    # Unset in the config: whatever the Ray's Serve runs, which start_ray wrote into this environment.
    direct_ingress = config.serve.direct_ingress
    if direct_ingress is None:
        direct_ingress = os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1"
    proxy_port = config.serve.port + 1 if direct_ingress else config.serve.port
    serve.start(http_options={"host": config.serve.host, "port": proxy_port})
    logger.info("deploying application %s (model %s)", config.serve.app_name, config.engine_config().model_name)
    serve.run(build_app(config), name=config.serve.app_name, route_prefix=config.serve.route_prefix, blocking=False)
    host = "127.0.0.1" if config.serve.host in ("0.0.0.0", "::") else config.serve.host
    prefix = config.serve.route_prefix.rstrip("/")
    url = f"http://{host}:{config.serve.port}{prefix}/v1"
    logger.info("pagedserve is ready: %s (model %s)", url, config.engine_config().model_name)
    return url


def engine_actors(config: AppConfig) -> list[Any]:
    """The application's scheduler actors that exist now, of every model."""
    from serve_app.engines import existing_engines

    return existing_engines(config, config.serve.app_name)


def drain(config: AppConfig, grace_s: float, hurry: threading.Event | None = None) -> dict[str, int]:
    """Refuse new requests (503), wait up to `grace_s` for the ones in flight, then end those left with an error.

    Returns {"in_flight": requests at the start, "cut": requests ended by the deadline}.
    """
    import ray

    engines = engine_actors(config)
    if not engines:
        return {"in_flight": 0, "cut": 0}
    ray.get([engine.drain.remote() for engine in engines], timeout=RAY_CALL_TIMEOUT_S)

    def in_flight() -> int:
        try:
            stats = ray.get([engine.stats.remote() for engine in engines], timeout=RAY_CALL_TIMEOUT_S)
        except ray.exceptions.RayError as error:
            logger.warning("engine stats unavailable while draining: %s", error)
            return 0
        return sum(engine_stats.num_running + engine_stats.num_waiting for engine_stats in stats)

    at_start = remaining = in_flight()
    logger.info("draining: no new requests; %d in flight get up to %.0f s to finish", at_start, grace_s)
    deadline = time.monotonic() + grace_s
    while remaining and time.monotonic() < deadline and not (hurry is not None and hurry.is_set()):
        time.sleep(0.2)
        remaining = in_flight()
    cut = 0
    if remaining:
        reason = "the server shut down before this request finished"
        cut = sum(ray.get([engine.fail_requests.remote(reason) for engine in engines], timeout=RAY_CALL_TIMEOUT_S))
        logger.warning("grace period over: ended %d requests still in flight", cut)
    return {"in_flight": at_start, "cut": cut}


def shutdown(config: AppConfig, grace_s: float, owns_ray: bool, hurry: threading.Event | None = None) -> None:
    """Graceful shutdown: drain, delete the application (its replicas, scheduler actors, workers and placement
    groups go with it), and stop Serve and Ray when this process started them."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        drain(config, grace_s, hurry)
    except Exception:
        logger.exception("draining failed; shutting down anyway")
    try:
        if owns_ray:
            serve.shutdown()
        else:
            # Other applications on a shared cluster keep running.
            serve.delete(config.serve.app_name)
    except Exception:
        logger.exception("stopping Serve failed")
    finally:
        if owns_ray:
            ray.shutdown()
    logger.info("pagedserve stopped")


def app_exists(config: AppConfig) -> bool:
    """False once the application is gone (for example after `serve shutdown`); errors count as present."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return config.serve.app_name in serve.status().applications
    except RayServeException:
        return False
    except Exception as error:
        logger.warning("could not read the Serve status: %s", error)
        return True


def abandon_startup(config: AppConfig, owns_ray: bool) -> None:
    """Stop a start-up that was interrupted or failed: nothing was served, so nothing is drained or waited for.

    An embedded Ray goes down whole (its replicas, scheduler actors and workers with it) without waiting for Serve
    to stop replicas that are still loading. On a cluster started elsewhere the application is deleted and its
    scheduler actors killed without waiting; an engine that a dying replica creates anew ends itself once no ingress
    is attached (ENGINE_ORPHAN_TIMEOUT_S).
    """
    import ray
    from ray import serve

    if owns_ray:
        # Also when ray.init itself was interrupted: shutdown stops whatever part of the node it started.
        ray.shutdown()
        logger.info("pagedserve stopped")
        return
    if not ray.is_initialized():
        return
    try:
        serve.delete(config.serve.app_name, _blocking=False)
        for engine in engine_actors(config):
            ray.kill(engine)
    except Exception:
        logger.exception("removing the application that was starting failed")
    finally:
        ray.shutdown()  # only disconnects from a Ray started elsewhere
    logger.info("pagedserve stopped; Serve removes the application %s in the background", config.serve.app_name)


def serve_forever(config: AppConfig, grace_s: float = DEFAULT_GRACE_S) -> None:
    """Serve until SIGINT/SIGTERM (or until the application is deleted elsewhere), then shut down gracefully; a
    second signal ends the grace period at once. A signal during start-up interrupts it and stops everything
    without waiting for the replicas to finish starting."""
    import ray

    stop = threading.Event()
    hurry = threading.Event()
    # Set while Ray starts and the app deploys: those calls block in Ray, so a signal interrupts them (as Ctrl-C
    # does, which Ray's blocking calls honour) instead of only setting state that is read once they return.
    starting = threading.Event()
    starting.set()

    def on_signal(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if starting.is_set():
            starting.clear()  # one interrupt: a second signal during the clean-up only hurries it
            logger.info("%s during start-up: stopping", name)
            raise KeyboardInterrupt
        if stop.is_set():
            hurry.set()
        logger.info("%s: shutting down", name)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    owns_ray = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    served = interrupted = False
    try:
        start_ray(config)
        # ray.init installs its own SIGTERM handler (sys.exit): ours must win, or the drain is skipped.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_signal)
        deploy(config)
        # Cleared before `served` is set: a signal in between stops gracefully instead of interrupting.
        starting.clear()
        served = True
        while not stop.wait(APP_CHECK_PERIOD_S):
            if not app_exists(config):
                logger.warning("application %s is gone (serve shutdown?); exiting", config.serve.app_name)
                break
    except KeyboardInterrupt:
        if served:
            raise
        interrupted = True
    finally:
        starting.clear()
        # A replica may answer before serve.run returns: requests it took are drained as after start-up.
        if served or requests_in_flight(config):
            shutdown(config, grace_s, owns_ray, hurry)
            interrupted = False
        else:
            abandon_startup(config, owns_ray)
    if interrupted:
        exit_now()


def requests_in_flight(config: AppConfig) -> bool:
    """Whether the application's engines hold requests now; an engine still loading does not."""
    import ray

    if not ray.is_initialized():
        return False
    try:
        engines = engine_actors(config)
        stats = ray.get([engine.stats.remote() for engine in engines], timeout=IN_FLIGHT_CHECK_S)
    except Exception:  # still being constructed (the timeout) or already gone: nothing was taken in
        return False
    return any(engine_stats.num_running + engine_stats.num_waiting for engine_stats in stats)


def exit_now(status: int = 0) -> None:
    """End the process without finalizing the interpreter: with Ray already stopped there is nothing left to
    release, and tearing down torch's and transformers' modules takes seconds on a busy machine."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
