"""Accounting over a synthetic history: GPU-hours, cost and idle waste per user, team and queue."""

from __future__ import annotations

import csv
import io
import json

import pytest

from scheduler.accounting import (
    JobRecord,
    PriceBook,
    PriceError,
    UtilIndex,
    UtilSample,
    render_report,
    render_sacct,
    usage,
)

H = 3600.0
WINDOW = (0.0, 100 * H)
NOW = 60 * H
PRICES = PriceBook.from_dict({
    "instances": {"p5.48xlarge": {"on_demand": 98.32, "spot": 31.46, "gpus": 8}},
    "pools": {"train-spot": {"kind": "aws", "instance_type": "p5.48xlarge", "spot": True},
              "train": {"kind": "aws", "instance_type": "p5.48xlarge"},
              "lab": {"kind": "onprem", "gpu_hour": 1.10}},
})
POOLS = {"a1": "train-spot", "a2": "train-spot", "l1": "lab"}
SPOT = 31.46 / 8

JOBS = [
    # 4 GPUs from 10 h before the window to 20 h into it: 80 GPU-h count
    JobRecord(1, "alice", "vision", "default", -10 * H, 20 * H, (("a1", (0, 1, 2, 3)),), "train", "COMPLETED"),
    # still running at NOW: 10 h x 2 GPUs
    JobRecord(2, "bob", "vision", "batch", 50 * H, None, (("l1", (0, 1)),), "eval", "RUNNING"),
    # two nodes, 12 GPUs, runs past the window's end: 10 h count
    JobRecord(3, "carol", "nlp", "default", 90 * H, 110 * H, (("a1", (4, 5, 6, 7)), ("a2", tuple(range(8)))),
              "pretrain", "TIMEOUT"),
    JobRecord(4, "dave", "nlp", "batch", 200 * H, 201 * H, (("a2", (0,)),), "later", "COMPLETED"),  # after
    JobRecord(5, "erin", "nlp", "batch", None, None, (), "waiting", "PENDING"),
]


def samples() -> list[UtilSample]:
    """Every minute: alice's GPUs idle until 5 h, carol's a2 GPUs at 2 % throughout, the rest busy."""
    out = []
    for minute in range(-10 * 60, 110 * 60):
        t = minute * 60.0
        for g in range(4):
            out.append(UtilSample("a1", g, t, 0.0 if t < 5 * H else 90.0))
        for g in range(4, 8):
            out.append(UtilSample("a1", g, t, 50.0))
        for g in range(8):
            out.append(UtilSample("a2", g, t, 2.0))
    return out


UTIL = UtilIndex(samples())


@pytest.mark.parametrize("by,want", [
    ("user", {"alice": (80, 80 * SPOT, 20), "bob": (20, 22.0, 0), "carol": (120, 120 * SPOT, 80)}),
    ("account", {"vision": (100, 80 * SPOT + 22.0, 20), "nlp": (120, 120 * SPOT, 80)}),
    ("queue", {"default": (200, 200 * SPOT, 100), "batch": (20, 22.0, 0)}),
])
def test_totals_per_user_team_and_queue_within_one_percent(by, want):
    rows = usage(JOBS, WINDOW, POOLS, PRICES, UTIL, by=by, now=NOW)
    got = {r.key: (r.gpu_hours, r.cost, r.idle_gpu_hours) for r in rows}
    assert set(got) == set(want)
    for key, (hours, cost, idle) in want.items():
        assert got[key] == pytest.approx((hours, cost, idle), rel=0.01, abs=1e-9), key


def test_rows_are_largest_first_and_count_runs_in_the_window():
    rows = usage(JOBS, WINDOW, POOLS, PRICES, UTIL, by="user", now=NOW)
    assert [(r.key, r.jobs) for r in rows] == [("carol", 1), ("alice", 1), ("bob", 1)]


def test_a_pool_without_a_price_is_reported_not_guessed():
    rows = usage(JOBS, WINDOW, {"a1": "unknown-pool"}, PRICES, by="account", now=NOW)
    vision = next(r for r in rows if r.key == "vision")
    assert vision.unpriced_gpu_hours == pytest.approx(80 + 20)
    assert vision.cost == 0


def test_waste_needs_telemetry_and_a_sample_stands_only_so_long():
    util = UtilIndex([UtilSample("n", 0, 0.0, 0.0), UtilSample("n", 0, 10 * H, 0.0)], max_gap_s=H)
    job = JobRecord(1, "u", "t", "q", 0.0, 20 * H, (("n", (0,)),))
    (row,) = usage([job], (0.0, 20 * H), {"n": "lab"}, PRICES, util, now=NOW)
    assert row.idle_gpu_hours == pytest.approx(2.0)  # two samples, one hour each


def test_on_demand_and_spot_prices_per_gpu():
    assert PRICES.price("train") == pytest.approx(98.32 / 8)
    assert PRICES.price("train-spot") == pytest.approx(31.46 / 8)
    assert PRICES.price("lab") == 1.10


@pytest.mark.parametrize("cfg,message", [
    ({"pools": {"x": {"kind": "aws", "instance_type": "p4d.24xlarge"}}},
     "pool x runs 'p4d.24xlarge' but accounting.instances has no price for it"),
    ({"pools": {"x": {"kind": "onprem", "gpu_hour": "cheap"}}},
     "accounting.pools.x.gpu_hour must be a price (a number of 0 or more), not 'cheap'"),
    ({"pools": {"x": {"kind": "gcp"}}}, 'accounting.pools.x.kind must be "aws" or "onprem", not \'gcp\''),
    ({"instances": {"p5": {"on_demand": 1, "spot": 1, "gpus": 0}},
      "pools": {"x": {"kind": "aws", "instance_type": "p5"}}},
     'accounting.instances."p5".gpus must be a whole number above 0, not 0'),
])
def test_a_wrong_price_table_is_refused_by_name(cfg, message):
    with pytest.raises(PriceError) as e:
        PriceBook.from_dict(cfg)
    assert message in str(e.value)


def test_sacct_table_with_format_and_widths():
    out = render_sacct(JOBS[:3], "JobID,User%6,Partition,AllocGPUS,NodeList%4,State,Elapsed", now=NOW)
    lines = out.splitlines()
    assert lines[0].split() == ["JobID", "User", "Partition", "AllocGPUS", "Nod+", "State", "Elapsed"]  # as sacct: cut with +
    assert lines[1].split() == ["-" * 10, "-" * 6, "-" * 10, "-" * 10, "-" * 4, "-" * 10, "-" * 10]
    assert lines[2].split() == ["1", "alice", "default", "4", "a1", "COMPLETED", "1-06:00:00"]
    assert lines[4].split() == ["3", "carol", "default", "12", "a1,+", "TIMEOUT", "20:00:00"]
    assert lines[3].split()[-1] == "10:00:00"  # running: up to now


def test_sacct_json_csv_and_parsable():
    rows = json.loads(render_sacct(JOBS[:2], "JobID,Account,GPUHours", output="json", now=NOW))
    assert rows == [{"JobID": "1", "Account": "vision", "GPUHours": "120.00"},
                    {"JobID": "2", "Account": "vision", "GPUHours": "20.00"}]
    assert list(csv.reader(io.StringIO(render_sacct(JOBS[:1], "JobID,State", output="csv")))) == [
        ["JobID", "State"], ["1", "COMPLETED"]]
    assert render_sacct(JOBS[:1], "JobID,State", output="parsable") == "JobID|State\n1|COMPLETED\n"


def test_sacct_unknown_field_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown sacct field 'Foo'; fields: JobID, JobName"):
        render_sacct(JOBS, "JobID,Foo")


def test_report_as_table_json_and_csv():
    rows = usage(JOBS, WINDOW, POOLS, PRICES, UTIL, by="account", now=NOW)
    text = render_report(rows, "account", WINDOW)
    assert "GPU usage by account" in text and "Cost (USD)" in text
    line = next(ln for ln in text.splitlines() if "nlp" in ln)
    assert "120.00" in line and "80.00" in line and "66.7" in line
    data = json.loads(render_report(rows, "account", WINDOW, output="json"))
    assert data["total"]["gpu_hours"] == pytest.approx(220)
    assert data["total"]["idle_gpu_hours"] == pytest.approx(100)
    table = list(csv.reader(io.StringIO(render_report(rows, "account", WINDOW, output="csv"))))
    assert table[0] == ["Account", "GPU-hours", "Idle GPU-hours", "Idle %", "Cost", "Jobs"]
    assert table[-1][:3] == ["TOTAL", "220.00", "100.00"]
