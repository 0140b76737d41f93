"""Slurm drop-in: sbatch options, hostlists, output patterns, SLURM_* variables and commands."""
