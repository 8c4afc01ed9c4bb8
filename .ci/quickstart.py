"""The README's first commands as a shell script, for ``.ci/run`` to run from an empty folder.

    python3 .ci/quickstart.py README.md CHECKOUT > quickstart.sh

The first ```` ```bash ```` block of the README is what a newcomer types: clone, venv,
install, run. The script is that block as written, except that its ``git clone URL`` clones
``CHECKOUT`` (this repository's folder) instead, so no network is needed for the clone.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
CLONE = re.compile(r"\bgit clone (\S+)")


def quickstart(readme: str) -> str:
    """The README's first bash block."""
    m = BLOCK.search(readme)
    if m is None:
        raise ValueError("the README has no ```bash block")
    return m.group(1)


def localized(script: str, checkout: str | Path) -> str:
    """``script`` with its one ``git clone URL`` cloning ``checkout`` instead."""
    clones = CLONE.findall(script)
    if len(clones) != 1:
        raise ValueError(f"the quickstart should clone once, it has {len(clones)} git clone")
    return CLONE.sub(lambda m: "git clone " + shlex.quote(str(checkout)), script)


def main(argv: list[str]) -> int:
    readme, checkout = argv
    try:
        sys.stdout.write(localized(quickstart(Path(readme).read_text(encoding="utf-8")), checkout))
    except ValueError as e:
        print(f"error: {readme}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
