"""Where the ranks of a tensor-parallel group run (no torch here: start_server.sh reads it too).

MP_NUM ranks over MP_NNODE nodes, MP_NUM / MP_NNODE on each (one per GPU: local rank i uses the
i-th visible device). Node k (its index in POD_IPS, or NODE_RANK) runs ranks k*L .. k*L + L - 1.
Node 0 serves: Triton, the HTTP front end, health, metrics and the engine, whose core process is
rank 0 and schedules; every other node runs only its workers (node.py).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from llmserve.config import Config, ConfigError


class RendezvousError(RuntimeError):
    """The ranks of a group could not meet (executor/group.py, runners/paddle/ranks.py)."""


@dataclass(frozen=True)
class Layout:
    world: int  # MP_NUM
    nodes: int  # MP_NNODE
    node: int  # this node's index
    master: str  # node 0's address (the store, the step channel)
    port: int  # DIST_PORT
    ips: tuple[str, ...]

    @property
    def per_node(self) -> int:
        return self.world // self.nodes

    def node_ranks(self) -> range:
        return range(self.node * self.per_node, (self.node + 1) * self.per_node)

    def where(self, rank: int) -> str:
        """'rank 3 (node 1, 10.0.0.2)' for messages."""
        k = rank // self.per_node
        ip = self.ips[k] if k < len(self.ips) else self.master
        return f"rank {rank} (node {k}, {ip})"


def _host_addresses() -> set[str]:
    names = {socket.gethostname(), socket.getfqdn()}
    found = set()
    for n in names:
        try:
            found |= {a[4][0] for a in socket.getaddrinfo(n, None)}
        except OSError:
            pass
    return found


def layout(config: Config) -> Layout:
    ips = tuple(config.node_ips)
    node = config.node_rank
    if node is None:
        if config.mp_nnode == 1:
            node = 0
        else:
            mine = _host_addresses()
            matches = [i for i, ip in enumerate(ips) if ip in mine]
            if len(matches) != 1:
                raise ConfigError(
                    f"POD_IPS={config.pod_ips!r}: none of them is this host's address ({', '.join(sorted(mine))}); "
                    "set NODE_RANK to this node's index"
                )
            node = matches[0]
    master = config.pod_0_ip or (ips[0] if ips else "127.0.0.1")
    return Layout(config.mp_num, config.mp_nnode, node, master, config.dist_port, ips)
