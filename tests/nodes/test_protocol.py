"""The agent protocol's encoding: every message, op or event, is one JSON line holding its tag
and every field as it is, and decodes back to the same message."""

from __future__ import annotations

import dataclasses
import json

import pytest

from scheduler import protocol as P

SAMPLES = {"str": "gpu-07", "int": 42, "float": 1.5, "bool": True}


def sample(cls):
    """A message of `cls` with a value in each of its fields (nested lists and dicts too)."""
    kw = {}
    for f in dataclasses.fields(cls):
        t = str(f.type)
        if t in SAMPLES:
            kw[f.name] = SAMPLES[t]
        elif t.startswith("list[dict"):
            kw[f.name] = [{"gpus": [0, 1], "node": "n1"}]
        elif t.startswith("list"):
            kw[f.name] = ["a", "b"]
        elif t.startswith("dict"):
            kw[f.name] = {"K": {"nested": [1, 2]}}
        elif "int" in t:
            kw[f.name] = 7
        elif "str" in t:
            kw[f.name] = "x"
        elif "float" in t:
            kw[f.name] = 0.25
    return cls(**kw)


@pytest.mark.parametrize("cls", [*P.OPS.values(), *P.EVENTS.values()], ids=lambda c: c.__name__)
def test_a_message_is_one_line_of_its_tag_and_every_field_and_decodes_back(cls):
    msg = sample(cls)
    line = P.encode(msg)
    assert line.endswith("\n") and "\n" not in line[:-1]
    obj = json.loads(line)
    tag = {"op": msg.op} if hasattr(msg, "op") else {"ev": msg.ev}
    # what dataclasses.asdict gives, through JSON (a tuple is a list there)
    assert obj == json.loads(json.dumps({**tag, **dataclasses.asdict(msg)}))
    assert list(obj)[0] == next(iter(tag))
    decoded = P.decode_op(obj) if "op" in tag else P.decode_event(obj)
    assert P.encode(decoded) == line


def test_the_encoded_dict_is_a_copy_of_the_message_not_the_message_itself():
    msg = P.Launch(key="1.0", job_id=1, argv=["true"])
    d = P.to_dict(msg)
    d["key"] = "changed"
    assert msg.key == "1.0"
