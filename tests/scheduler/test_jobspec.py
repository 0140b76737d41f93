"""Job request values as a Slurm user writes them (times and sizes: test_units.py)."""

import pytest

from scheduler.jobspec import parse_env


def test_env_pairs_and_bad_names():
    assert parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError, match="1BAD=2"):
        parse_env(["1BAD=2"])
