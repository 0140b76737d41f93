"""What `trainyard daemon` runs with: trainyard.toml read, validated and converted (scheduler.settings)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import ConfigDict

from .health import HealthRules
from .planner.policy import PolicyConfig
from .settings import DaemonSettings, NodesSettings, Settings, read_toml


class DaemonConfig(DaemonSettings):
    """What `trainyard daemon` runs with: the [daemon] keys as attributes, the other tables
    converted for the parts that use them (`policy_config`, `health_rules`, `users`, `nodes`).

    `--listen` and `--db` on the command line replace the file's values by assignment, which
    is validated like the file.
    """

    model_config = ConfigDict(frozen=False, validate_assignment=True)

    settings: Settings = Settings()
    # the raw tables as written, for code that still parses them itself
    document: dict[str, Any] = {}

    @classmethod
    def load(cls, path: str | Path | None) -> DaemonConfig:
        if path is None:
            return cls()
        document = read_toml(path)
        settings = Settings.from_toml(document, str(Path(path).expanduser()))
        return cls(**settings.daemon.model_dump(), settings=settings, document=document)

    @cached_property
    def policy_config(self) -> PolicyConfig:
        return self.settings.to_policy()

    @cached_property
    def health_rules(self) -> HealthRules:
        return self.settings.to_health()

    @property
    def users(self) -> dict[str, str]:
        """trainyard user -> Unix account the user's jobs run as."""
        return dict(self.settings.users)

    @property
    def nodes(self) -> NodesSettings:
        return self.settings.nodes

    @property
    def queue_aliases(self) -> dict[str, str]:
        return self.settings.queue_aliases()

    @property
    def policy(self) -> dict[str, Any]:
        """The raw [scheduler], [queues.*] and [teams.*] tables (use `policy_config`)."""
        doc = {k: v for k, v in self.document.items() if k in ("scheduler", "queues", "teams")}
        if "queues" in doc:  # aliases are resolved by the API, not the planner
            doc["queues"] = {name: {k: v for k, v in q.items() if k != "aliases"}
                             for name, q in doc["queues"].items()}
        return doc

    @property
    def health(self) -> dict[str, Any]:
        """The raw [health] table (use `health_rules`)."""
        return dict(self.document.get("health", {}))
