"""Where a membership's process groups meet: one TCP key-value store per coordinator.

Contract: ``RendezvousStore(host)`` starts a ``torch.distributed.TCPStore`` server on
``host`` (a free port) on first use and keeps it for the life of the object; ``address()``
is ``"host:port"``. Every generation's process group rendezvouses under its own key prefix
(``elastic.coord.membership``), so members of different generations never meet. The store
holds only rendezvous keys (a few hundred bytes per member and generation), never state.
``host`` defaults to ``BATON_RENDEZVOUS_HOST``, else this machine's address as the
resolver gives it (the coordinator's node on a Ray cluster passes its node address).
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

HOST_ENV = "BATON_RENDEZVOUS_HOST"


def default_host() -> str:
    configured = os.environ.get(HOST_ENV)
    if configured:
        return configured
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class RendezvousStore:
    def __init__(self, host: str | None = None) -> None:
        self.host = host or default_host()
        self._store: object | None = None
        self._lock = threading.Lock()
        self._port = 0

    def address(self) -> str:
        with self._lock:
            if self._store is None:
                import torch.distributed as dist

                store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                      timeout=timedelta(seconds=60))
                self._store, self._port = store, store.port
            host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6
            return f"{host}:{self._port}"
