import logging
from pathlib import Path

import pytest

from offsetflow.cli.console import console_level, progress_line, setup_logging
from offsetflow.ranges import OffsetRange


def test_progress_line_shows_ranges_records_rate_and_commit() -> None:
    ranges = [OffsetRange("orders", p, 100, 200) for p in range(4)] + [
        OffsetRange("orders", 9, 5, 5)]  # an empty range is not shown
    line = progress_line({"batch_id": 7, "status": "committed", "rows_written": 399,
                          "bad_records": 1, "read_stage_s": 1.5, "commit_s": 0.5},
                         ranges, "orders")
    assert line == ("pipeline orders: batch 7 committed in 0.50s: 4 range(s) "
                    "orders[0] [100, 200), orders[1] [100, 200), orders[2] [100, 200) +1 more; "
                    "400 offsets -> 399 rows, 1 dead letters, 200 rec/s")


def test_progress_line_of_an_empty_cycle() -> None:
    assert progress_line({"batch_id": None, "status": "empty"}, [], "o") == \
        "pipeline o: caught up, nothing new to read"


@pytest.mark.parametrize("verbose, detailed, level", [
    (0, False, logging.WARNING), (1, False, logging.INFO), (2, False, logging.DEBUG),
    (0, True, logging.INFO)])
def test_console_level(verbose: int, detailed: bool, level: int) -> None:
    assert console_level(verbose, detailed) == level


def test_info_goes_to_the_file_not_the_console(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        path = setup_logging(0, tmp_path / "sub" / "of.log")
        logging.getLogger("offsetflow.x").info("detail %d", 1)
        logging.getLogger("offsetflow.x").warning("look %d", 2)
        for h in root.handlers:
            h.flush()
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:], root.level = saved[0], saved[1]
    assert path == tmp_path / "sub" / "of.log"
    err = capsys.readouterr().err
    assert "look 2" in err and "detail 1" not in err
    text = path.read_text()
    assert "INFO offsetflow.x: detail 1" in text and "WARNING offsetflow.x: look 2" in text
