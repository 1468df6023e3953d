"""A host tier below the device cache (SGLang's HiCache): its configuration and how the policy
values a state that may sit on the host.

The two tiers hold one logical cache. Under ``write_back`` an item is on the device or on the host
(the device demotes what it evicts, a load-back moves it up), so the logical cache holds
``device + host`` bytes; under ``write_through`` the host holds a copy of everything, so it holds
``max(device, host)``. The policy decides what the logical cache keeps (its admission and its
eviction order over both tiers); the device holds the most recently used part of it (SGLang's
device eviction is LRU, what it evicts goes down) and the rest is on the host.

A device hit saves the recompute of the resumed prefix. A host hit saves the same recompute but
first copies the state (and the KV the device lacks) up, which costs ``bytes / load_bandwidth``
seconds; in the eviction score's unit that is ``bytes * device_flops / load_bandwidth`` prefill
FLOPs. :class:`HostCost` subtracts the expected load (the host's share of the logical cache times
a state's load) from every FLOPs-saved value the evictor reads.

Units: bytes, bytes per second, FLOPs, FLOP per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Host-to-device copy bandwidth (bytes/s) assumed when none is given: about what a pinned
#: ``cudaMemcpyAsync`` reaches over PCIe Gen4 x16 (~25 GB/s; Gen5 ~50). A GPU owner measures
#: theirs (benchmarks/gpu/README.md); SGLang's HiCache loads through the same link.
DEFAULT_LOAD_BANDWIDTH = 25e9
#: Prefill throughput (FLOP/s) assumed when none is given: ~40% of an H100's dense bf16 peak.
DEFAULT_DEVICE_FLOPS = 400e12
#: SGLang's ``--hicache-write-policy`` names: ``write_back`` copies a state (with the KV it needs)
#: to the host when the device evicts it, ``write_through`` when it is cached on the device
WRITE_POLICIES = ("write_back", "write_through")


@dataclass(frozen=True)
class HostTierConfig:
    """A host tier of ``budget_bytes`` (KV + states, bytes) below the device.

    ``load_bandwidth``: host-to-device bytes per second; ``device_flops``: prefill FLOP per second
    (together they convert a load into the prefill FLOPs it costs); ``write_policy``: one of
    :data:`WRITE_POLICIES`.
    """

    budget_bytes: int
    load_bandwidth: float = DEFAULT_LOAD_BANDWIDTH
    device_flops: float = DEFAULT_DEVICE_FLOPS
    write_policy: str = "write_back"

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"host budget_bytes must be > 0, got {self.budget_bytes}")
        if not self.load_bandwidth > 0:
            raise ValueError(f"load_bandwidth must be > 0 bytes/s, got {self.load_bandwidth}")
        if not self.device_flops > 0:
            raise ValueError(f"device_flops must be > 0 FLOP/s, got {self.device_flops}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy must be one of {', '.join(WRITE_POLICIES)}, got {self.write_policy!r}"
            )

    def logical_bytes(self, device_bytes: int) -> int:
        """Bytes the two tiers hold together over a device of ``device_bytes`` (module docstring)."""
        if self.write_policy == "write_through":
            return max(int(device_bytes), self.budget_bytes)
        return int(device_bytes) + self.budget_bytes

    def host_share(self, device_bytes: int) -> float:
        """The share of the logical cache that sits on the host (a cached item's chance, when it is
        next used, of needing a load)."""
        total = self.logical_bytes(device_bytes)
        return max(0.0, 1.0 - device_bytes / total) if total else 0.0

    @property
    def flops_per_byte(self) -> float:
        """Prefill FLOPs the device could have run while one byte is loaded."""
        return self.device_flops / self.load_bandwidth

    def load_flops(self, num_bytes: int) -> float:
        """A load of ``num_bytes`` expressed in prefill FLOPs (the device time it takes)."""
        return num_bytes * self.flops_per_byte


class HostCost:
    """The cost model of a logical two-tier cache's evictor: ``cost`` with :meth:`node_flops_saved`
    net of the expected load (module docstring). Everything else is ``cost``'s (attribute access is
    delegated) except the bytes, the ones the loads are priced with, so it can stand wherever a
    :class:`~.cost_model.ModelCostModel` does. ``kv_bytes_per_token`` / ``state_bytes`` (bytes): what
    a load moves when the engine's pools hold other sizes than ``cost``'s model (default ``cost``'s)."""

    def __init__(
        self,
        cost: Any,
        config: HostTierConfig,
        host_share: float,
        *,
        kv_bytes_per_token: int | None = None,
        state_bytes: int | None = None,
    ) -> None:
        if not 0.0 <= host_share <= 1.0:
            raise ValueError(f"host_share must be in [0, 1], got {host_share}")
        self.cost = cost
        self.config = config
        self.host_share = float(host_share)
        kvb = cost.kv_bytes_per_token if kv_bytes_per_token is None else kv_bytes_per_token
        self.load_kv_bytes = int(kvb)
        self.load_state_bytes = int(cost.state_bytes if state_bytes is None else state_bytes)

    def __getattr__(self, name: str) -> Any:
        if name in ("cost", "config", "host_share", "load_kv_bytes", "load_state_bytes") or name.startswith(
            "__"
        ):
            raise AttributeError(name)  # not set yet (unpickling): never recurse
        return getattr(self.cost, name)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes per KV token (the engine's when given, else ``cost``'s): the load's and the budget's."""
        return self.load_kv_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes per state (the engine's when given, else ``cost``'s): the load's and the budget's."""
        return self.load_state_bytes

    def node_flops_saved(self, pos: int, fallback: int) -> float:
        """FLOPs a hit at ``pos`` saves net of its expected load (``host_share`` x the state and the
        KV of ``pos - fallback`` tokens; never below 0)."""
        load = self.load_state_bytes + max(0, pos - fallback) * self.load_kv_bytes
        saved = self.cost.node_flops_saved(pos, fallback)
        return max(0.0, saved - self.host_share * self.config.load_flops(load))
