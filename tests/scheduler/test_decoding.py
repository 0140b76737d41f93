"""The fast JSON paths (agent messages, JSON columns) read everything the old ones did: the NaN
and Infinity Python's encoder writes, and refuse what is not a message."""

from __future__ import annotations

import json
import math

import pytest
from sqlalchemy import text
from sqlmodel import Session

from scheduler.models import Job
from scheduler.nodes import decode_line
from scheduler.store import init_schema, make_engine


def test_an_agent_line_with_nan_telemetry_is_read():
    line = json.dumps({"ev": "telemetry", "gpus": [{"index": 0, "power_w": float("nan"),
                                                     "temp_c": float("inf")}]})
    msg = decode_line(line)
    assert msg["ev"] == "telemetry"
    assert math.isnan(msg["gpus"][0]["power_w"]) and msg["gpus"][0]["temp_c"] == math.inf
    assert decode_line('{"ev":"started","job":7}') == {"ev": "started", "job": 7}


@pytest.mark.parametrize("line", ["[1, 2]", "7", '"hello"', "{not json", ""])
def test_a_line_that_is_not_a_message_is_refused(line):
    with pytest.raises(ValueError):
        decode_line(line)


def test_a_json_column_written_with_nan_reads_back(tmp_path):
    engine = make_engine(str(tmp_path / "t.db"))
    init_schema(engine)
    with Session(engine) as s:
        s.add(Job(id=1, name="t", user="ana", queue="default", state="PENDING", command=["true"],
                  env={"A": "1"}))
        s.commit()
        # what an older daemon's `json` could have stored in a JSON column
        s.connection().execute(text("""UPDATE job SET "recorded" = '{"loss": NaN}', "env" = '{"A": "é"}'"""))
        s.commit()
    with Session(engine) as s:
        job = s.get(Job, 1)
        assert math.isnan(job.recorded["loss"]) and job.env == {"A": "é"}
        assert job.command == ["true"]
    engine.dispose()
