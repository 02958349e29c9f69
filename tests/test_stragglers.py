"""Stragglers: judged from published compute times, the same way on every member."""

from __future__ import annotations

import math

import pytest

from ftcomm.core.view import Status, StatusRecord
from ftcomm.gossip.runtime import Member
from ftcomm.runtime.stragglers import ComputeTimes, StragglerWatch, slow_members


def test_a_member_much_slower_than_the_others_is_flagged_even_in_a_group_of_two():
    assert slow_members({"a": 0.10, "b": 0.30}, 2.0) == {"b": 0.10}
    assert slow_members({"a": 0.10, "b": 0.11, "c": 0.50, "d": 0.09}, 2.0) == {"c": 0.10}
    assert slow_members({"a": 0.10, "b": 0.19, "c": 0.10}, 2.0) == {}


def test_noise_in_very_short_steps_flags_nobody_and_factor_0_turns_it_off():
    assert slow_members({"a": 0.001, "b": 0.004}, 2.0) == {}  # 4x, but 3 ms apart
    assert slow_members({"a": 0.1, "b": 1.0}, 0.0) == {}
    assert slow_members({"a": 0.1}, 2.0) == {}


def test_reports_are_changes_after_three_judgments_in_a_row():
    watch = StragglerWatch(2.0)
    slow, normal = {"a": 0.1, "b": 0.1, "c": 0.5}, {"a": 0.1, "b": 0.1, "c": 0.12}
    assert watch.judge(slow, at=1.0) == [] and watch.judge(slow, at=2.0) == []
    (flagged,) = watch.judge(slow, at=3.0)
    assert (flagged.member, flagged.slow, flagged.compute_s, flagged.others_s) == ("c", True, 0.5, 0.1)
    assert watch.judge(slow, at=4.0) == []  # still slow: nothing new
    assert watch.judge(normal, at=5.0) == [] and watch.judge(slow, at=6.0) == []  # a blip is no recovery
    assert watch.judge(normal, at=7.0) == [] and watch.judge(normal, at=8.0) == []
    (back,) = watch.judge(normal, at=9.0)
    assert (back.member, back.slow) == ("c", False)
    for t in (10.0, 11.0):
        assert watch.judge({"a": 0.3, "b": 0.1, "c": 0.1}, at=t) == []
    assert watch.judge(normal, at=12.0) == []  # a burst shorter than three judgments flags nobody
    for t in (13.0, 14.0, 15.0):
        watch.judge(slow, at=t)
    (gone,) = watch.judge({"a": 0.1, "b": 0.1}, at=16.0)  # it left the view: reported at once
    assert gone.member == "c" and not gone.slow and math.isnan(gone.compute_s)


def test_a_straggler_left_alone_with_a_figure_is_cleared_without_error():
    watch = StragglerWatch(2.0, patience=1)
    watch.judge({"a": 0.1, "c": 0.5}, at=1.0)
    (cleared,) = watch.judge({"c": 0.5}, at=2.0)  # its only peer left, or has no figure yet
    assert cleared.member == "c" and not cleared.slow and math.isnan(cleared.others_s)


def test_the_compute_time_is_a_median_over_a_window():
    times = ComputeTimes(3)
    assert times.median() is None
    for t in (0.1, 0.1, 5.0, 0.2):  # one hiccup does not make a straggler
        times.add(t)
    assert times.median() == 0.2
    times.add(-1.0)  # a clock step backwards is not a figure
    assert times.median() == 0.2


def test_the_status_record_carries_the_compute_time_and_refuses_nonsense():
    record = StatusRecord("active", 3, None, 1.0, "cf", 10, 5000, compute_s=0.0424).encode()
    assert record["ct"] == 42 and Status.from_metadata("m", "alive", record).compute_s == 0.042
    assert Status.from_metadata("m", "alive", StatusRecord("active", 3, None, 1.0, "cf", 10, 5000).encode()).compute_s is None
    for bad in (-1, "12", 1.5, 1 << 40):
        assert Status.from_metadata("m", "alive", {**record, "ct": bad}).compute_s is None


def test_ftcomm_members_marks_a_straggler():
    from ftcomm.ops.cli import _member_table

    def member(name: str, ct: int, step: int = 5) -> Member:
        return Member(f"{name}:1/x", name, 1, "alive", 0, {"st": step, "ct": ct, "ph": "active"})
    table = _member_table([member("a", 100), member("b", 110), member("c", 400)])
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:4]}
    assert rows["c:1/x"][5] == "400ms*" and rows["a:1/x"][5] == "100ms"
    assert "straggler" in table.splitlines()[-1]
    watched = _member_table([member("a", 100, step=25)], previous=(0.0, {"a:1/x": 5}), now=10.0)
    assert watched.splitlines()[0].split()[6] == "STEPS/S" and watched.splitlines()[1].split()[6] == "2.0"


@pytest.mark.parametrize("factor, window, error", [(-1.0, 20, ValueError), (2.0, 0, ValueError),
                                                   (2.0, 2.5, TypeError), ("2", 20, TypeError)])
def test_bad_straggler_options_are_refused(factor, window, error):
    from ftcomm.options import GroupOptions

    with pytest.raises(error, match="straggler"):
        GroupOptions(straggler_factor=factor, straggler_window=window)
