"""trainyard's terminal UI: a Textual client of the daemon's API."""
