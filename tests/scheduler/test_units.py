"""Durations and memory sizes: the one parser that the CLI, the API and trainyard.toml share."""

import math

import pytest

from scheduler.units import (
    MAX_DURATION_S,
    MAX_MEM_MIB,
    UnitError,
    format_duration,
    parse_duration,
    parse_mem,
    parse_time_limit,
)


@pytest.mark.parametrize("text, seconds", [
    ("90", 5400), ("1:30", 90), ("1:00:00", 3600), ("2-0", 172800), ("2-00", 172800),
    ("1-02:03", 93780), ("1-2:03:04", 93784), (" 10 ", 600), ("0", 0),
    ("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400), ("1.5h", 5400), ("2H", 7200),
    (45, 45), (2.5, 2.5), (0, 0),
])
def test_slurm_formats_suffixes_and_plain_seconds_are_read(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad, words", [
    ("soon", "cannot read 'soon' as a duration; use seconds, MM"),
    ("1:2:3:4", "cannot read '1:2:3:4'"),
    ("", "cannot read ''"),
    ("-5", "cannot read '-5'"),
    ("1w", "cannot read '1w'"),
    ("١٢", "cannot read '١٢'"),  # non-ASCII digits are not a time
    ("9" * 5000, "cannot read '9999"),  # no int() on a huge string
    (-1, "must be >= 0 seconds, got -1"),
    (math.nan, "expected a finite number of seconds, got nan"),
    (math.inf, "expected a finite number of seconds, got inf"),
    (True, "expected seconds or a time like 1:00:00, got True"),
    (None, "expected seconds .* got None"),
    ([60], r"expected seconds .* got \[60\]"),
    ("3651-0", "'3651-0' is longer than ten years"),
    (10**30, f"{10**30} is longer than ten years"),
])
def test_bad_durations_name_the_key_and_the_value(bad, words):
    with pytest.raises(ValueError, match=f"^queues.high.max_time: {words}"):
        parse_duration(bad, "queues.high.max_time")


def test_the_problem_is_available_without_the_key():
    with pytest.raises(UnitError) as e:
        parse_duration("soon", "scheduler.grace_period")
    assert e.value.key == "scheduler.grace_period"
    assert e.value.problem.startswith("cannot read 'soon'")


def test_ten_years_is_the_longest_duration():
    assert parse_duration(MAX_DURATION_S) == MAX_DURATION_S
    with pytest.raises(ValueError, match="ten years"):
        parse_duration(MAX_DURATION_S + 1)


def test_a_time_limit_is_whole_positive_seconds():
    assert parse_time_limit("1:30") == 90 and parse_time_limit(2.9) == 2
    for zero in ("0", 0, 0.5, "0:00"):
        with pytest.raises(ValueError, match=f"time limit: must be positive, got {zero!r}"):
            parse_time_limit(zero)


def test_durations_display_as_slurm_shows_them():
    assert format_duration(93784) == "1-02:03:04"
    assert format_duration(59) == "0:00:59"
    assert format_duration(None) == "-"


@pytest.mark.parametrize("text, mib", [
    ("16G", 16384), ("512M", 512), ("512", 512), ("1.5T", 1572864), ("16g", 16384),
    ("16GB", 16384), ("16GiB", 16384), ("100K", 1), ("0", 0), (64, 64), (1.5, 2),
])
def test_memory_is_mib_with_slurms_suffixes(text, mib):
    assert parse_mem(text) == mib


@pytest.mark.parametrize("bad, words", [
    ("lots", "cannot read 'lots' as a size; use e.g. 16G"),
    ("16X", "cannot read '16X'"),
    ("-1G", "cannot read '-1G'"),
    ("9" * 5000, "cannot read '9999"),
    (-1, "must not be negative, got -1"),
    (True, "expected a size like 16G or 512M, got True"),
    (math.inf, "expected a finite size, got inf"),
    ("65P", "cannot read '65P'"),
    ("65537T", "'65537T' is more than 64 PiB"),
    (2**63, f"{2**63} is more than 64 PiB"),
])
def test_bad_memory_names_the_key_and_the_value(bad, words):
    with pytest.raises(ValueError, match=f"^mem: {words}"):
        parse_mem(bad)


def test_64_pib_is_the_largest_size_and_fits_a_64_bit_column():
    assert parse_mem("64T") * 1024 == parse_mem(MAX_MEM_MIB) < 2**63
