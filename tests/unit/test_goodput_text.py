"""How the summary table words the goodput account."""

from __future__ import annotations


def test_a_short_runs_time_account_shows_its_parts_in_hundredths():
    """A 0.3 s run's summary read "startup 0.0 s (11%)": parts under a second now keep two decimals."""
    from scaletrain.observe.goodput import describe, seconds

    assert [seconds(s) for s in (0.0, 0.0335, 0.5, 1.0, 12.34)] == ["0.0 s", "0.03 s", "0.50 s", "1.0 s", "12.3 s"]
    good = {"parts_s": {"startup": 0.0335, "compute": 0.2116}, "fraction": {"startup": 0.111, "compute": 0.702}}
    assert describe(good) == "startup 0.03 s (11%), training 0.21 s (70%)"


def test_a_slow_rate_keeps_three_significant_digits():
    """A detection model on a CPU trains 0.27 samples/s, which the step line and the summary showed as 0."""
    from scaletrain.observe.throughput import per_second

    assert [per_second(r) for r in (0.2734, 4.5678, 99.94, 100.4, 123456.7)] == ["0.273", "4.57", "99.9", "100",
                                                                                 "123,457"]
