"""A bounded Schemathesis run (all checks, both roles) so CI keeps the API's contract true.

The long run (>= 20,000 cases) is `make fuzz`; see tests/fuzz/api_fuzz.py for what is excluded and why.
"""

from __future__ import annotations

import pytest

from tests.conftest import DaemonProc
from tests.fuzz.api_fuzz import cases, run_schemathesis


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProc(tmp_path_factory.mktemp("fuzz")).start()
    yield d
    d.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("role", ["admin", "user"])
def test_generated_requests_find_no_server_error_schema_violation_or_undocumented_status(daemon, role):
    token = daemon.token if role == "admin" else daemon.client().create_token(f"st-{role}", "user")["token"]
    r = run_schemathesis(daemon.url, token, max_examples=5, seed=20261123, admin=role == "admin", timeout=500, workers=2,
                         request_timeout=10)
    assert r.returncode == 0, r.stdout[-8000:]
    assert cases(r.stdout) > 150, r.stdout[-2000:]
