"""The daemon's terminal relay with a node agent that answers as an older or a refusing agent does
(what real sshd nodes cannot be made to say): the errors a client sees."""

from __future__ import annotations

import asyncio
import base64

import pytest

from scheduler.daemon.caller import Caller
from scheduler.daemon.clock import Clock
from scheduler.daemon.errors import Conflict
from scheduler.daemon.ptys import AgentTooOld, PtyExit, PtyOutput, PtyRelay
from scheduler.daemon.state import StateStore
from scheduler.models import Job
from scheduler.store import init_schema, make_engine


class Agent:
    """A node link whose agent answers pty_open with `reply`; records what the daemon sent."""

    def __init__(self, reply: dict):
        self.reply = reply
        self.sent: list[tuple[str, dict]] = []

    async def request(self, name: str, msg: dict, timeout: float = 10.0) -> dict:
        self.sent.append((name, msg))
        return self.reply

    def send(self, name: str, msg: dict) -> bool:
        self.sent.append((name, msg))
        return True

    def connected(self, name: str) -> bool:
        return True


@pytest.fixture
def store(tmp_path):
    engine = make_engine(str(tmp_path / "t.db"))
    init_schema(engine)
    st = StateStore(engine, Clock())
    with st.tx() as s:
        s.add(Job(id=7, user="ann", state="RUNNING", attempt=2, allocation=[{"node": "n1", "gpus": [0]}]))
    return st


ANN = Caller("ann", "user")


def test_an_agent_without_terminals_is_named_with_what_to_do(store):
    relay = PtyRelay(store, Agent({"ev": "error", "error": "ProtocolError: unknown op 'pty_open'; known: ..."}))
    with pytest.raises(AgentTooOld) as e:
        asyncio.run(relay.open(ANN, 7))
    assert e.value.kind == "not_implemented"
    assert "update the agent on n1" in str(e.value)
    assert relay.sessions == {}


def test_the_agents_refusal_reaches_the_client(store):
    relay = PtyRelay(store, Agent({"ev": "error", "error": "job 7 is not running on n1 (exited)"}))
    with pytest.raises(Conflict, match="job 7 is not running on n1"):
        asyncio.run(relay.open(ANN, 7))


def test_output_is_acknowledged_once_delivered_and_the_end_closes_the_session(store):
    agent = Agent({"ev": "pty_opened", "pty": "", "pid": 42})
    relay = PtyRelay(store, agent)

    async def scenario():
        session = await relay.open(ANN, 7, argv=["bash"], rows=30, cols=100)
        opened = agent.sent[0][1]
        assert (opened["op"], opened["key"], opened["argv"], opened["rows"]) == ("pty_open", "7.2", ["bash"], 30)
        relay.on_event("n1", {"ev": "pty_data", "pty": session.name, "offset": 0,
                              "data": base64.b64encode(b"hi").decode()})
        relay.on_event("n2", {"ev": "pty_data", "pty": session.name, "offset": 2, "data": ""})  # wrong node
        out = await session.next()
        assert out == PtyOutput(b"hi", 2)
        session.delivered(out.offset)
        assert agent.sent[-1] == ("n1", {"op": "pty_ack", "pty": session.name, "offset": 2})
        relay.on_event("n1", {"ev": "pty_close", "pty": session.name, "rc": 0, "reason": ""})
        assert await session.next() == PtyExit(0, "")
        assert relay.sessions == {}

    asyncio.run(scenario())


def test_a_new_agent_on_the_node_ends_the_terminals_of_the_old_one(store):
    relay = PtyRelay(store, Agent({"ev": "pty_opened", "pty": "", "pid": 42}))

    async def scenario():
        session = await relay.open(ANN, 7)
        relay.node_restarted("n2")  # another node: nothing happens here
        assert relay.sessions
        relay.node_restarted("n1")
        end = await session.next()
        assert end.rc is None and "link to n1 was re-established" in end.reason
        assert relay.sessions == {}

    asyncio.run(scenario())
