"""Private registries: per-registry credentials from a secret file, handed to a node for a pull only."""

from __future__ import annotations

import tomllib

from ..config import read_private
from ..containers import ContainerError, parse_image


def load_credentials(path: str) -> dict[str, dict[str, str]]:
    """REGISTRY -> {"username", "password"}; ValueError (naming the file and the problem) when the
    file is missing, readable by others, or malformed. The values are never logged."""
    if not path:
        return {}
    text = read_private(path, "nodes.registry_credentials")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"nodes.registry_credentials: cannot read {path!r}: {type(e).__name__}") from None
    out: dict[str, dict[str, str]] = {}
    for registry, entry in data.items():
        if not isinstance(entry, dict) or set(entry) != {"username", "password"} or \
                not all(isinstance(v, str) and v for v in entry.values()):
            raise ValueError(f"nodes.registry_credentials: [{registry!r}] needs exactly username and "
                             "password, as text")
        out[registry] = {"username": entry["username"], "password": entry["password"]}
    return out


class Registries:
    def __init__(self, credentials: dict[str, dict[str, str]]):
        self._credentials = credentials

    def auth_for(self, image: str) -> dict[str, str] | None:
        try:
            registry = parse_image(image).registry
        except ContainerError:
            return None
        return self._credentials.get(registry) or None

    def __repr__(self) -> str:  # never the secrets, whatever prints this
        return f"Registries({sorted(self._credentials)})"



