"""`trainyard tui`: open the terminal UI on a daemon."""

from __future__ import annotations

import click


def _default_settings() -> tuple[str | None, str | None]:
    try:
        from scheduler.client import load_settings

        return load_settings()
    except Exception:  # no settings yet: the options then must be given
        return None, None


@click.command("tui")
@click.option("--url", envvar="TRAINYARD_URL", help="daemon URL (default: client settings)")
@click.option("--token", envvar="TRAINYARD_TOKEN", help="API token (default: client settings)")
@click.option("--readonly", is_flag=True, help="hide and refuse every action that changes the cluster")
@click.option("--refresh", type=click.FloatRange(0.5, 60), default=2.0, show_default=True,
              metavar="SECONDS", help="how often to poll the daemon")
def tui(url: str | None, token: str | None, readonly: bool, refresh: float) -> None:
    """Nodes, GPUs, queues and jobs, live (k9s-style keys; ? for help)."""
    if not url or not token:
        default_url, default_token = _default_settings()
        url, token = url or default_url, token or default_token
    if not url or not token:
        raise click.UsageError(
            "no daemon to talk to: pass --url and --token, set TRAINYARD_URL and TRAINYARD_TOKEN, "
            "or start a daemon once so that ~/.config/trainyard/client.toml exists")
    from tui.app import run_tui

    run_tui(url, token, readonly=readonly, refresh=refresh)
