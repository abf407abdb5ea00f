"""Spreads requests over the engine replicas behind one ingress: by load, or by prompt prefix."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

from serve_app.engine_client import EngineClient


def prefix_key(prompt_token_ids: Sequence[int], prefix_tokens: int) -> int:
    """A stable hash of the prompt's first tokens: the same on every ingress replica and every run."""
    data = b"".join(token_id.to_bytes(4, "little", signed=True) for token_id in prompt_token_ids[:prefix_tokens])
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_owner(key: int, replica_indices: Sequence[int]) -> int:
    """The replica index that owns a prefix key: rendezvous hashing, so when replicas come and go only the prefixes
    of those replicas move."""

    def weight(index: int) -> bytes:
        return hashlib.blake2b(key.to_bytes(8, "little") + index.to_bytes(4, "little"), digest_size=8).digest()

    return max(replica_indices, key=weight)


class EngineSet(Protocol):
    def routable(self) -> list[EngineClient]: ...

    async def wait_for_engine(self) -> list[EngineClient]: ...


class EngineRouter:
    def __init__(self, engines: EngineSet, policy: str, prefix_tokens: int):
        self.engines = engines
        self.policy = policy
        self.prefix_tokens = prefix_tokens

    async def pick(self, prompt_token_ids: Sequence[int]) -> EngineClient:
        """least_loaded: fewest requests in flight from this ingress. prefix: the replica owning the prompt's
        first `prefix_tokens` tokens (its prefix cache likely holds them), unless it is far busier than the rest.
        With no replica running (scaled to zero) the request waits for one."""
        clients = self.engines.routable() or await self.engines.wait_for_engine()
        # A replica found down a moment ago takes nothing while another is up.
        clients = [client for client in clients if client.available] or clients
        if len(clients) == 1:
            return clients[0]
        least_loaded = min(clients, key=lambda client: client.num_in_flight)
        if self.policy != "prefix" or len(prompt_token_ids) < self.prefix_tokens:
            return least_loaded
        owner_index = prefix_owner(
            prefix_key(prompt_token_ids, self.prefix_tokens), [client.replica_index for client in clients]
        )
        owner = next(client for client in clients if client.replica_index == owner_index)
        # A hot prefix must not pile every request onto one replica.
        if owner.num_in_flight > 2 * least_loaded.num_in_flight + 8:
            return least_loaded
        return owner


def merge_expositions(expositions: Sequence[bytes]) -> bytes:
    """Several engines' Prometheus texts as one: each family's HELP/TYPE once, then every engine's samples."""
    families: dict[str, dict[str, list[str]]] = {}
    current = None
    for exposition in expositions:
        for line in exposition.decode().splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                current = line.split(" ", 3)[2]
                family = families.setdefault(current, {"meta": [], "samples": []})
                if len(family["meta"]) < 2:
                    family["meta"].append(line)
            elif line and current is not None:
                families[current]["samples"].append(line)
    lines = []
    for family in families.values():
        lines += family["meta"] + family["samples"]
    return ("\n".join(lines) + "\n").encode()
