"""Reading an autoscaled replica's load: a number alone, or a Prometheus metric summed over
its labels; anything else is no reading (the replica keeps its last)."""

from __future__ import annotations

import pytest

from federation.agent.service import parse_load

PROMETHEUS = """# HELP requests_in_flight Requests being served.
# TYPE requests_in_flight gauge
requests_in_flight{model="a"} 3
requests_in_flight{model="b"} 2.5 1700000000000
requests_in_flight_max 40
other_metric 7
"""


@pytest.mark.parametrize(
    ("text", "metric", "expected"),
    [
        ("4\n", "", 4.0),
        (" 0.5 ", "", 0.5),
        (PROMETHEUS, "requests_in_flight", 5.5),
        (PROMETHEUS, "other_metric", 7.0),
        (PROMETHEUS, "missing", None),
        ("busy", "", None),
        ("-1", "", None),
        ("nan", "", None),
        ("inf", "", None),
        ("requests_in_flight{", "requests_in_flight", None),
        ("requests_in_flight", "requests_in_flight", None),
    ],
)
def test_a_load_answer_is_read_or_refused(text: str, metric: str, expected: float | None) -> None:
    assert parse_load(text, metric) == expected
