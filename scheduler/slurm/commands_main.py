"""`python -m scheduler.slurm.commands_main sbatch ...`: the Slurm commands without an install."""

from .commands import slurm

if __name__ == "__main__":
    slurm(prog_name="slurm")
