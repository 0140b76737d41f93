"""`python -m scheduler` runs the trainyard CLI."""

from .cli import main

main()
