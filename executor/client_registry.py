"""Which ingress replicas use a scheduler actor, which requests each owns, and when one is gone.

An ingress with requests in flight reads its outputs at least every OUTPUT_POLL_TIMEOUT_S, and every live ingress
pings on Serve's health check: a lease per client, renewed by each call. The watcher aborts the requests of a
client whose lease ran out and, for an engine shared by ingress replicas, ends the engine once none is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator

logger = logging.getLogger(__name__)

# Every live ingress pings on Serve's health check (every 10 s); silent this long, it no longer counts as attached.
CLIENT_LEASE_S = 60.0
# How long an abort that arrived before its request is remembered (Ray may run an async actor's calls out of order).
EARLY_ABORT_MEMORY_S = 120.0
# Beyond this many remembered early aborts, the expired ones are dropped.
MAX_EARLY_ABORTS = 1024


class ClientRegistry:
    """Client leases, request ownership and early aborts: plain bookkeeping, no engine. The actor aborts in its
    engine what `forget` returns."""

    def __init__(self, request_lease_s: float, orphan_timeout_s: float | None):
        """`request_lease_s`: a client with requests that is silent this long has died. `orphan_timeout_s`: with
        no client heard from for this long the engine ends itself; None: never."""
        self.request_lease_s = request_lease_s
        self.orphan_timeout_s = orphan_timeout_s
        self.last_seen: dict[str, float] = {}
        self.last_activity = time.monotonic()
        # Clients inside attach, waiting for the engine to start: present, however long the start takes.
        self.num_attaching = 0
        self.request_owner: dict[str, str] = {}
        self.early_aborts: dict[str, float] = {}
        # Why a client's requests were ended behind its back, kept until its next read (or CLIENT_LEASE_S).
        self.lease_failures: dict[str, tuple[str, float]] = {}

    @property
    def num_clients(self) -> int:
        return len(self.last_seen)

    def knows(self, client_id: str) -> bool:
        """Whether the client counts as attached (not detached, forgotten or silent past its lease)."""
        return client_id in self.last_seen

    def touch(self, client_id: str) -> None:
        """The client is alive: renew its lease."""
        self.last_seen[client_id] = self.last_activity = time.monotonic()

    @contextlib.contextmanager
    def attaching(self, client_id: str) -> Iterator[None]:
        """The client counts as present while it waits inside attach, and is touched on the way in and out."""
        self.touch(client_id)
        self.num_attaching += 1
        try:
            yield
        finally:
            self.num_attaching -= 1
            self.touch(client_id)

    def add_request(self, request_id: str, client_id: str) -> None:
        self.request_owner[request_id] = client_id

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.request_owner.pop(request_id, None)

    def release_all_requests(self) -> set[str]:
        """Forget every request in flight; returns the clients that had any."""
        owners = set(self.request_owner.values())
        self.request_owner.clear()
        return owners

    def has_requests(self, client_id: str) -> bool:
        return client_id in self.request_owner.values()

    def forget(self, client_id: str, failure: str | None = None) -> list[str]:
        """Drop a client and its requests; returns their ids (for the engine to abort). With `failure`, the
        client's next read learns its requests were ended, instead of waiting for them."""
        request_ids = [request_id for request_id, owner in self.request_owner.items() if owner == client_id]
        self.forget_requests(request_ids)
        self.last_seen.pop(client_id, None)
        if failure is not None:
            self.lease_failures[client_id] = (failure, time.monotonic())
        return request_ids

    def has_lease_failure(self, client_id: str) -> bool:
        return client_id in self.lease_failures

    def take_lease_failure(self, client_id: str) -> str | None:
        failure = self.lease_failures.pop(client_id, None)
        return None if failure is None else failure[0]

    def remember_early_aborts(self, request_ids: Iterable[str]) -> None:
        """Aborts of requests not (yet) in the engine: the request is dropped if it arrives after all."""
        now = time.monotonic()
        for request_id in request_ids:
            self.early_aborts[request_id] = now
        if len(self.early_aborts) > MAX_EARLY_ABORTS:
            self.early_aborts = {
                request_id: when for request_id, when in self.early_aborts.items() if when > now - EARLY_ABORT_MEMORY_S
            }

    def take_early_abort(self, request_id: str) -> bool:
        """Whether an abort overtook this request (then it must not be queued)."""
        return self.early_aborts.pop(request_id, None) is not None

    async def watch(
        self, forget_client: Callable[[str, str | None], list[str]], end_engine: Callable[[], Awaitable[None]]
    ) -> None:
        """Forever: `forget_client` (with a failure) each client that stopped reading its outputs (it died) and
        (without) each gone quiet; `end_engine` once no client is left at all, when the engine is orphanable."""
        period = min(self.request_lease_s, self.orphan_timeout_s or self.request_lease_s) / 4
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            polling = set(self.request_owner.values())
            for client_id, seen in list(self.last_seen.items()):
                if client_id in polling and seen < now - self.request_lease_s:
                    failure = (
                        f"the ingress did not read its outputs for {self.request_lease_s:.0f} s; "
                        "its requests were aborted"
                    )
                    request_ids = forget_client(client_id, failure)
                    logger.warning("ingress %s went silent: aborted its %d requests", client_id, len(request_ids))
                elif seen < now - CLIENT_LEASE_S:
                    forget_client(client_id, None)
            for client_id, (_, since) in list(self.lease_failures.items()):
                if since < now - CLIENT_LEASE_S:
                    del self.lease_failures[client_id]  # that ingress is gone for good
            silent_s = now - self.last_activity
            if self.orphan_timeout_s is not None and not self.num_attaching and silent_s > self.orphan_timeout_s:
                logger.warning("no ingress for %.0f s: this engine ends itself", self.orphan_timeout_s)
                await end_engine()
                return
