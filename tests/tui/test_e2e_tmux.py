"""End to end: `trainyard tui` in a real terminal (tmux) against a demo cluster; drain a node
through the confirm screen, as a person would."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler.client import Client

TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed")


def _tmux(socket: str, *args: str) -> str:
    return subprocess.run([TMUX, "-f", "/dev/null", "-L", socket, *args], capture_output=True, text=True,
                          check=True).stdout


def _wait_for(socket: str, text: str, tries: int = 150, line_with: str = "") -> str:
    """The pane once `text` shows (on the line holding `line_with`, if given); bounded."""
    pane = ""
    for _ in range(tries):
        pane = _tmux(socket, "capture-pane", "-p", "-t", "tui")
        lines = [ln for ln in pane.splitlines() if line_with in ln] if line_with else [pane]
        if any(text in ln for ln in lines):
            return pane
        time.sleep(0.1)
    return pane


def test_drain_a_node_in_a_real_terminal(demo_cluster, tmp_path):
    url, token = demo_cluster
    socket = f"trainyard-e2e-{tmp_path.name}"
    trainyard = Path(sys.executable).with_name("trainyard")
    command = f"env -u COLUMNS -u LINES TERM=xterm-256color {trainyard} tui --url {url} --token {token} --refresh 1"
    _tmux(socket, "new-session", "-d", "-s", "tui", "-x", "140", "-y", "36", command)
    try:
        _wait_for(socket, "node-2")
        pane = _wait_for(socket, "● live")  # the header's source may answer after the nodes'
        assert "node-1" in pane and "node-2" in pane and "● live" in pane
        _tmux(socket, "send-keys", "-t", "tui", "D")
        pane = _wait_for(socket, "Drain 1 node?")
        assert "• node-1" in pane
        _tmux(socket, "send-keys", "-t", "tui", "-l", "e2e maintenance")
        _tmux(socket, "send-keys", "-t", "tui", "Enter")
        pane = _wait_for(socket, "e2e maintenance", line_with="node-1")
        line = next((ln for ln in pane.splitlines() if "node-1" in ln), "")
        assert "DRAIN" in line and "e2e maintenance" in line
        node = Client(url, token).node("node-1")
        assert node["state"] in ("DRAINING", "DRAINED") and node["reason"] == "e2e maintenance"
        _tmux(socket, "send-keys", "-t", "tui", "q")
    finally:
        subprocess.run([TMUX, "-L", socket, "kill-server"], capture_output=True)
