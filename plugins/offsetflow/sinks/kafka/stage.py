"""Reading the stage for the Kafka topic sink: a server-side cursor fetched by a thread of its
own, a bounded number of fetches ahead, so PostgreSQL builds the next fetch's records (JSON
values, keys) while the driver produces this one's (psycopg2 releases the GIL while it
waits for the server). The order is the query's; memory is `depth` + 2 fetches."""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator
from typing import Any

import psycopg2.extensions
from psycopg2 import sql

_DONE = object()


def prefetched(conn: psycopg2.extensions.connection, name: str, query: sql.Composable,
               rows_per_fetch: int, depth: int = 2
               ) -> Generator[list[tuple[Any, ...]], None, None]:
    """The rows of `query` in fetches of `rows_per_fetch`, in order. The connection is used
    by the fetching thread only until this generator is closed (it waits for the thread)."""
    chunks: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                chunks.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def fetch() -> None:
        try:
            with conn.cursor(name=name) as rows:
                rows.itersize = rows_per_fetch
                rows.execute(query)
                while not stop.is_set():
                    chunk = rows.fetchmany(rows_per_fetch)
                    if not chunk or not put(chunk):
                        break
            put(_DONE)
        except BaseException as e:  # raised in the consuming thread
            put(e)

    t = threading.Thread(target=fetch, name=f"{name}-fetch", daemon=True)
    t.start()
    try:
        while True:
            item = chunks.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        t.join()
