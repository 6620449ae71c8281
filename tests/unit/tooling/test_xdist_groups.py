"""The scheduler's longest-first order of test files (tests/tooling/xdist_groups.py)."""

from __future__ import annotations

from tests.tooling.xdist_groups import UNKNOWN_SECONDS_PER_TEST, longest_first


def unit(path: str, n: int) -> dict[str, bool]:
    return {f"{path}::test_{i}": False for i in range(n)}


def test_recorded_seconds_order_the_units_not_their_number_of_tests() -> None:
    queue = {"tests/unit/a.py": unit("tests/unit/a.py", 40),
             "tests/integration/slow.py": unit("tests/integration/slow.py", 2),
             "tests/integration/mid.py": unit("tests/integration/mid.py", 5)}
    durations = {"tests/unit/a.py": 3.0, "tests/integration/slow.py": 150.0,
                 "tests/integration/mid.py": 40.0}
    assert longest_first(queue, durations) == [
        "tests/integration/slow.py", "tests/integration/mid.py", "tests/unit/a.py"]


def test_a_group_sums_its_files_and_an_unknown_file_is_estimated_per_test() -> None:
    group = {**unit("tests/x/one.py", 1), **unit("tests/x/two.py", 1)}
    queue = {"group": group, "tests/new.py": unit("tests/new.py", 10)}
    durations = {"tests/x/one.py": 30.0, "tests/x/two.py": 30.0}
    # the group: 60 s recorded; the new file: 10 tests at the per-test estimate (50 s)
    assert 10 * UNKNOWN_SECONDS_PER_TEST == 50
    assert longest_first(queue, durations) == ["group", "tests/new.py"]
    # no record: both by the estimate (2 tests against 10)
    assert longest_first(queue, {}) == ["tests/new.py", "group"]
