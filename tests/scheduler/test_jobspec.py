"""Job request values as a Slurm user writes them."""

import pytest

from scheduler.jobspec import format_time, parse_env, parse_mem, parse_time, sbatch_directives


@pytest.mark.parametrize("text,seconds", [
    ("30", 1800), ("1:30", 90), ("1:00:00", 3600), ("2-00", 172800), ("1-02:03", 93780),
    ("1-02:03:04", 93784), (120, 120),
])
def test_slurm_time_formats_are_understood(text, seconds):
    assert parse_time(text) == seconds


@pytest.mark.parametrize("bad", ["abc", "1:2:3:4", "", "-5", "0", 0, "1h"])
def test_bad_time_is_refused_with_the_value_and_the_formats(bad):
    with pytest.raises(ValueError) as e:
        parse_time(bad)
    assert repr(bad) in str(e.value)


def test_format_time_round_trips_for_display():
    assert format_time(93784) == "1-02:03:04"
    assert format_time(59) == "0:00:59"


@pytest.mark.parametrize("text,mb", [("16G", 16384), ("512M", 512), ("1.5T", 1572864), ("2048", 2048), (64, 64)])
def test_memory_sizes(text, mb):
    assert parse_mem(text) == mb


def test_bad_memory_names_the_value():
    with pytest.raises(ValueError, match="'lots'"):
        parse_mem("lots")


def test_env_pairs_and_bad_names():
    assert parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError, match="1BAD=2"):
        parse_env(["1BAD=2"])


def test_sbatch_directives_are_read_until_the_first_command():
    script = """#!/bin/bash
#SBATCH --job-name=llama
#SBATCH -N 2 --gres=gpu:8
#SBATCH --time=2:00:00
# a comment
#SBATCH --mem=64G
srun python train.py
#SBATCH --nodes=99
"""
    assert sbatch_directives(script) == {"name": "llama", "nodes": 2, "gpus": 8, "time_limit": "2:00:00",
                                         "mem": "64G"}


def test_unknown_sbatch_option_is_named_with_its_line():
    with pytest.raises(ValueError, match=r"line 2: unsupported #SBATCH option '--mail-user'"):
        sbatch_directives("#!/bin/sh\n#SBATCH --mail-user=x@y\n")
