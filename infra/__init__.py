"""The Pulumi program for trainyard's clusters (AWS GPU pools, declared on-prem hosts) and `trainyard infra`.

Importing this package must stay cheap: `trainyard infra` is loaded lazily by the CLI, and only
the modules that build resources (`cluster`, `program`) or drive the engine (`automation`)
import Pulumi.
"""
