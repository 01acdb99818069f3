"""How an ``fd serve`` instance joins a cluster: FastDeploy's ``--scheduler-*`` flags."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace

from fd_core.cluster.global_scheduler import ROLES, RedisAddress, new_instance_id
from fd_core.errors import ConfigError

SCHEDULERS = ("local", "global", "splitwise")
REDIS_CALL_TIMEOUT_S = 0.5  # a front end's Redis call from its event loop blocks at most this long
REDIS_POLL_S = 0.5  # how long one wait for a front end's outputs lasts


@dataclass(frozen=True)
class SchedulerConfig:
    """``name``: local (this instance alone, no Redis: the default), global (instances share
    work through Redis), splitwise (global, with prefill and decode instances);
    ``role``: mixed, or prefill / decode in a splitwise cluster;
    ``ttl``: seconds after its last load report that an instance counts as dead; ``topic``:
    the cluster's name, so that several clusters may share one Redis."""

    name: str = "local"
    host: str = "127.0.0.1"
    port: int = 6379
    password: str | None = None
    ttl: float = 10.0
    topic: str = "default"
    role: str = "mixed"
    # prefill/decode disaggregation: the KV-cache connector (fd_core.interfaces.kv_transfer),
    # and where a decode instance's listens (port 0: any free one)
    cache_transfer_protocol: str = "tcp"
    pd_comm_host: str = "127.0.0.1"
    pd_comm_port: int = 0
    instance_id: str = ""  # set when the instance starts

    def __post_init__(self) -> None:
        if self.name not in SCHEDULERS:
            raise ConfigError(f"--scheduler-name {self.name}: expected one of {', '.join(SCHEDULERS)}")
        if self.role not in ROLES:
            raise ConfigError(f"--role {self.role}: expected one of {', '.join(ROLES)}")
        if self.role != "mixed" and self.name != "splitwise":
            raise ConfigError(f"--role {self.role}: a prefill or decode instance joins a disaggregated cluster: "
                              f"give --scheduler-name splitwise (and the cluster's --scheduler-host/-port)")
        if not 0 <= self.pd_comm_port < 65536:
            raise ConfigError(f"--pd-comm-port {self.pd_comm_port}: a port is a number from 0 (any) to 65535")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--scheduler-port {self.port}: a port is a number from 1 to 65535")
        if not self.ttl > 0:
            raise ConfigError(f"--scheduler-ttl {self.ttl:g}: must be a positive number of seconds")
        if not self.topic or ":" in self.topic:
            raise ConfigError(f"--scheduler-topic {self.topic!r}: a non-empty name without ':'")

    @property
    def is_global(self) -> bool:
        """Whether the instance works through the cluster's Redis (global, splitwise)."""
        return self.name in ("global", "splitwise")

    @property
    def address(self) -> RedisAddress:
        return RedisAddress(self.host, self.port, self.password)

    def started(self) -> SchedulerConfig:
        """This config with an instance id of its own (the role, the host and a random part)."""
        if self.instance_id:
            return self
        host = socket.gethostname().split(".")[0] or "host"
        return replace(self, instance_id=f"{new_instance_id(self.role)}-{host}-{os.getpid()}")
