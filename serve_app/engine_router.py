"""Spreads requests over the engine replicas behind one ingress: by load, or by prompt prefix."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from serve_app.engine_client import EngineClient


def prefix_key(prompt_token_ids: Sequence[int], prefix_tokens: int) -> int:
    """A stable hash of the prompt's first tokens: the same on every ingress replica and every run."""
    data = b"".join(token_id.to_bytes(4, "little", signed=True) for token_id in prompt_token_ids[:prefix_tokens])
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class EngineRouter:
    def __init__(self, clients: Sequence[EngineClient], policy: str, prefix_tokens: int):
        self.clients = list(clients)
        self.policy = policy
        self.prefix_tokens = prefix_tokens

    def pick(self, prompt_token_ids: Sequence[int]) -> EngineClient:
        """least_loaded: fewest requests in flight from this ingress. prefix: the replica owning the prompt's
        first `prefix_tokens` tokens (its prefix cache likely holds them), unless it is far busier than the rest."""
        if len(self.clients) == 1:
            return self.clients[0]
        least_loaded = min(self.clients, key=lambda client: client.num_in_flight)
        if self.policy != "prefix" or len(prompt_token_ids) < self.prefix_tokens:
            return least_loaded
        owner = self.clients[prefix_key(prompt_token_ids, self.prefix_tokens) % len(self.clients)]
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
