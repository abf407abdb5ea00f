"""Which LoRA adapter each worker slot holds, and which adapters the running requests pin (scheduler side).

A running request pins its adapter's slot: the running requests never use more than `max_loras` adapters, so no
step does. An adapter without a slot takes a free one (an empty slot first, then the least recently used slot no
running request pins) when its first request is admitted; one still in a slot from earlier runs without a reload.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SlotAssignment:
    slot: int
    needs_load: bool
    """The adapter was not in the slot: the plan ships it to the workers."""


class AdapterSlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slot_adapter: list[int | None] = [None] * max_loras  # adapter id per slot
        self.recency: list[int] = list(range(max_loras))  # slots, least recently used first
        self.num_running: dict[int, int] = {}  # adapter id -> running requests that use it

    @property
    def num_pinned(self) -> int:
        return len(self.num_running)

    def slot_of(self, adapter_id: int) -> int | None:
        try:
            return self.slot_adapter.index(adapter_id)
        except ValueError:
            return None

    def can_run(self, adapter_id: int) -> bool:
        """A request of this adapter may be admitted now: the adapter is pinned already, or a slot can be freed."""
        return adapter_id in self.num_running or self.num_pinned < self.max_loras

    def acquire(self, adapter_id: int) -> SlotAssignment:
        """Pin the adapter for one more running request (call only where `can_run`)."""
        slot = self.slot_of(adapter_id)
        needs_load = slot is None
        if slot is None:
            pinned = {self.slot_of(pinned_id) for pinned_id in self.num_running}
            empty = [index for index in self.recency if self.slot_adapter[index] is None]
            unpinned = [index for index in self.recency if index not in pinned]
            if not (empty or unpinned):
                raise RuntimeError(f"no LoRA slot is free for adapter {adapter_id} ({self.max_loras} pinned)")
            slot = (empty or unpinned)[0]
            self.slot_adapter[slot] = adapter_id
        self.recency.remove(slot)
        self.recency.append(slot)
        self.num_running[adapter_id] = self.num_running.get(adapter_id, 0) + 1
        return SlotAssignment(slot, needs_load)

    def release(self, adapter_id: int) -> None:
        """A request of this adapter stopped running (finished or preempted); the adapter stays in its slot."""
        remaining = self.num_running.get(adapter_id, 0) - 1
        if remaining > 0:
            self.num_running[adapter_id] = remaining
        else:
            self.num_running.pop(adapter_id, None)

    def forget(self, adapter_id: int) -> None:
        """The adapter was unloaded: its slot is free (no running request may use it)."""
        if adapter_id in self.num_running:
            raise RuntimeError(f"adapter {adapter_id} is still used by running requests")
        slot = self.slot_of(adapter_id)
        if slot is not None:
            self.slot_adapter[slot] = None
