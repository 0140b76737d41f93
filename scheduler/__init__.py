"""trainyard's scheduler: the daemon, its state, its planner, node sessions, API and CLI."""

__version__ = "0.1.0"
