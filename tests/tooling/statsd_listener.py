"""A real StatsD listener for tests: a UDP socket on 127.0.0.1 collecting the datagrams
Airflow's Stats sends ("name:value|type", InfluxDB-style tags as ",k=v" after the name)."""

from __future__ import annotations

import socket
import threading
import time


class StatsdListener:
    """Collects StatsD datagrams ("name:value|type") sent to 127.0.0.1:<port>."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._got = threading.Event()  # set on every datagram
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            self.lines += data.decode().splitlines()
            self._got.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def values(self, name: str) -> list[tuple[float, str]]:
        out = []
        for line in self.lines:
            stat, _, rest = line.partition(":")
            if stat == name:
                value, _, kind = rest.partition("|")
                out.append((float(value), kind.split("|")[0]))
        return out

    def wait_for(self, name: str, n: int, timeout_s: float = 10.0) -> list[tuple[float, str]]:
        """The values of `name` once at least `n` arrived (UDP: they come asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while len(self.values(name)) < n and time.monotonic() < deadline:
            self._got.wait(0.2)
            self._got.clear()
        return self.values(name)
