"""The HTTP API: app.py wires one router per resource (routers/), schemas.py, errors.py, deps.py."""

from .app import create_app

__all__ = ["create_app"]
