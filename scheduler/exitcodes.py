"""Exit codes of every `trainyard` command (DESIGN.md), so scripts can tell failures apart."""

from __future__ import annotations

OK = 0
# the daemon refused the request, or the operation ran and failed (message on stderr)
REFUSED = 1
FAILED = REFUSED
# the command line or a configuration file is wrong; nothing was done
USAGE = 2
# the daemon (or the service the command needs) cannot be reached, or none is configured
UNREACHABLE = 3
