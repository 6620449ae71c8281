"""One Spark Connect session per pipeline, reused across DAG runs (issue 19).

Each server-side session starts its own Python worker daemon and workers (~210 MB), and the
server keeps them after the session is released: a new session per scheduled run grows the
server's memory with every run and makes every run pay a cold worker start. So a pipeline's
runs open the session with a deterministic id (the pipeline's name and the server's address)
and only drop their client at the end; the server keeps the session warm for the next run.

Pipelines get separate ids, so what one run sets on its session (spark.conf) never reaches
another pipeline's run; each run sets its settings again. A session the server closed (a
release, its idle timeout) cannot be reopened under its id (INVALID_HANDLE.SESSION_CLOSED),
so the next id of a short deterministic sequence is used; a restarted server knows no id and
makes a new session under the first one.
"""

from __future__ import annotations

import uuid

# fixed: changing it moves every pipeline to a new session (and leaves the old ones' workers)
NAMESPACE = uuid.UUID("5b0c7a52-3f0e-4d7e-9a51-0ff5e7f10c19")
# closed ids to step over before giving up on reuse (one short RPC each)
MAX_GENERATIONS = 64


def session_id(pipeline: str, url: str, generation: int = 0) -> str:
    """The session id of `pipeline`'s runs on the server at `url` (its parameters, such as
    a token, are not part of its identity). A version-4 UUID, as pyspark's client checks."""
    address = url.split(";", 1)[0].rstrip("/")
    digest = uuid.uuid5(NAMESPACE, f"{pipeline}\0{address}\0{generation}")
    return str(uuid.UUID(bytes=digest.bytes, version=4))


def with_session_id(url: str, sid: str) -> str:
    """`url` (sc://host:port[/;params]) naming session `sid`."""
    base = url.rstrip("/") if ";" not in url else url.rstrip(";")
    return f"{base};session_id={sid}" if ";" in url else f"{base}/;session_id={sid}"


def names_session(url: str) -> bool:
    """Whether the URL already names a session (the user's choice, used as it is)."""
    return any(p.split("=", 1)[0].strip() == "session_id" for p in url.split(";")[1:])


def is_closed_session(err: BaseException) -> bool:
    """The server refused a session id it closed before (it does not reopen one)."""
    return "SESSION_CLOSED" in str(err)
