#!/usr/bin/env python3
"""scontrol inside a trainyard job: `show hostnames [LIST]` and `show hostlist LIST`.

Stdlib only; loads hostlist.py from the directory above this one. Everything else that
scontrol does (show job, hold, requeue, ...) is `trainyard slurm scontrol` on a login host.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from hostlist import HostlistError, compress, expand  # noqa: E402


def main(argv: list[str]) -> int:
    args = [a for a in argv if a not in ("-o", "--oneliner")]
    if len(args) >= 2 and args[0] == "show" and args[1] in ("hostnames", "hostname"):
        text = args[2] if len(args) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
        if not text:
            print("scontrol: error: no hostlist given and SLURM_JOB_NODELIST is not set", file=sys.stderr)
            return 1
        try:
            names = expand(text)
        except HostlistError as e:
            print(f"scontrol: error: {e}", file=sys.stderr)
            return 1
        print("\n".join(names))
        return 0
    if len(args) == 3 and args[0] == "show" and args[1] == "hostlist":
        print(compress(args[2].split(",")))
        return 0
    print(f"scontrol: error: inside a job only `scontrol show hostnames [LIST]` and `show hostlist "
          f"LIST` work here, not {' '.join(argv)!r}; run `trainyard slurm scontrol ...` on a login host",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
