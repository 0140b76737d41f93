"""The backends the app is given speak the `Backend` protocol: the fake cannot drift from it."""

from __future__ import annotations

import inspect

import pytest
from fake_backend import FakeBackend

from tui.backend import Backend, HttpBackend

METHODS = [name for name, value in vars(Backend).items()
           if callable(value) and not name.startswith("_")]


@pytest.mark.parametrize("cls", [FakeBackend, HttpBackend], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", METHODS)
def test_backend_offers_every_call_of_the_protocol_with_its_parameters(cls, name):
    wanted = list(inspect.signature(getattr(Backend, name)).parameters)
    offered = list(inspect.signature(getattr(cls, name)).parameters)
    assert offered == wanted, f"{cls.__name__}.{name}{offered} differs from the protocol"


def test_the_protocol_covers_what_the_app_calls():
    assert {"me", "cluster", "nodes", "jobs", "queues", "teams", "events", "stream_events", "log",
            "submit", "cancel", "hold", "release", "requeue", "set_priority", "drain_node",
            "resume_node", "close"} <= set(METHODS)
