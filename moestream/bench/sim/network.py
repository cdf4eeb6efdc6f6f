"""Network links between ranks for the multi-rank simulator, as named presets (`25gbe`, `100gbe`,
`400gbe`, `nvlink`): effective bandwidth per direction of one rank pair's link and the latency of
one message on it, estimates from the links' nominal rates (derived in docs/simulator.md).
Bandwidths are decimal (1 GB/s = 1e9 B/s). Knows nothing of ranks, experts or policies.
"""

from __future__ import annotations

from dataclasses import dataclass

from moestream.errors import MoestreamError

NO_NETWORK = "none"  # every message is free: one rank, or an ideal network


@dataclass(frozen=True)
class NetworkLink:
    name: str
    gbps: float  # effective bandwidth per direction, GB/s
    latency_ms: float  # one message's fixed cost
    source: str = ""

    def __post_init__(self):
        if self.gbps <= 0 or self.latency_ms < 0:
            raise MoestreamError(f"network {self.name!r}: need gbps > 0 and latency_ms >= 0")

    def message_ms(self, nbytes: int) -> float:
        """One message of nbytes from one rank to another."""
        return self.latency_ms + nbytes / (self.gbps * 1e6)


NETWORKS: dict[str, NetworkLink] = {
    link.name: link
    for link in (
        NetworkLink("25gbe", 2.9, 0.025, "25 Gb/s Ethernet, TCP: 3.125 GB/s nominal, ~93% effective"),
        NetworkLink("100gbe", 11.6, 0.010, "100 Gb/s Ethernet, RoCEv2: 12.5 GB/s nominal, ~93% effective"),
        NetworkLink("400gbe", 46.0, 0.008, "400 Gb/s Ethernet/NDR: 50 GB/s nominal, ~92% effective"),
        NetworkLink("nvlink", 370.0, 0.005, "NVLink 4 (H100): 450 GB/s per direction nominal"),
    )
}


def get_network(name: str) -> NetworkLink | None:
    """The named preset; None for `none` (messages cost nothing)."""
    if name == NO_NETWORK:
        return None
    if name not in NETWORKS:
        raise MoestreamError(f"--network: unknown network {name!r}; known: {', '.join([NO_NETWORK, *sorted(NETWORKS)])}")
    return NETWORKS[name]
