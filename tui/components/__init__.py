"""Widgets and screens of the trainyard TUI."""
