"""`chaos.wait_for_reconnect`: the wait that replaced a fixed sleep after killing the broker
(issue 27) ends on a connection from the process it watches, not on anyone else's, and not
at all once there is nothing left to wait for."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from tests.tooling import chaos

# a client that keeps trying to reach a port, as librdkafka does a dead broker
RETRYING = """
import socket, sys, time
while True:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).recv(1)
    except OSError:
        pass
    time.sleep(0.05)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_connection_from_the_watched_process_ends_the_wait_with_its_pid() -> None:
    port = free_port()
    other = subprocess.Popen([sys.executable, "-c", RETRYING, str(port)])
    watched = subprocess.Popen([sys.executable, "-c", RETRYING, str(port)])
    try:
        pid = chaos.wait_for_reconnect(f"127.0.0.1:{port}", watched.pid, lambda: False, 30)
        assert pid == watched.pid  # the other client's connections did not count
        # a child of the test process counts, the test process itself never does
        assert chaos.wait_for_reconnect(f"127.0.0.1:{port}", os.getpid(), lambda: False,
                                        30) in (other.pid, watched.pid)
    finally:
        for p in (other, watched):
            p.kill()
            p.wait()


def test_the_wait_ends_without_a_client_once_unless_holds() -> None:
    t = time.monotonic()
    assert chaos.wait_for_reconnect(f"127.0.0.1:{free_port()}", os.getpid(),
                                    lambda: time.monotonic() - t > 0.5, 30) is None
    assert time.monotonic() - t < 5
