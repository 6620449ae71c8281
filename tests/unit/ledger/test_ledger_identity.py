"""Where a ledger's identity was made (review M1): another database name, or another
server where both system identifiers are known, is another database."""

from __future__ import annotations

from offsetflow.ledger.identity import Home


def test_home_differs_by_name_or_by_a_known_server() -> None:
    home = Home("offsetflow", "7001")
    assert not home.differs(Home("offsetflow", "7001"))
    assert home.differs(Home("offsetflow_staging", "7001"))  # CREATE DATABASE ... TEMPLATE
    assert home.differs(Home("offsetflow", "7002"))  # a dump restored on another server
    # a server whose identifier is not readable: the name is all there is
    assert not home.differs(Home("offsetflow", None))
    assert not Home("offsetflow", None).differs(Home("offsetflow", "7002"))
    assert str(Home("offsetflow", None)) == "database offsetflow (server system identifier ?)"
