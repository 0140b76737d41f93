"""Entry point of the Pulumi program (`Pulumi.yaml` says `main: infra/`)."""

import sys
from pathlib import Path

# The language host runs this directory as a script; make `import infra` resolve to this checkout.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from infra.program import main  # noqa: E402

main()
