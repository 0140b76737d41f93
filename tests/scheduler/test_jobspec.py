"""Job request values as a Slurm user writes them (times and sizes: test_units.py)."""

import pytest

from scheduler.jobspec import parse_env, sbatch_directives


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
