"""Print a pip constraints file that pins every runtime dependency at the floor pyproject.toml
declares (``name>=X`` -> ``name==X``): what ``make test-floor`` installs, so that the declared
ranges are the tested ones. Runtime: [project] dependencies and the ``local`` and ``tracing`` extras."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

RUNTIME_EXTRAS = ("local", "tracing")
_FLOOR = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(.*)$")


def floors(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in RUNTIME_EXTRAS:
        requirements.extend(project["optional-dependencies"][extra])
    pins = []
    for requirement in requirements:
        match = _FLOOR.match(requirement)
        if match is None:
            raise SystemExit(f"cannot read the requirement {requirement!r}")
        name, _, spec = match.groups()
        clauses = [clause.strip() for clause in spec.split(",") if clause.strip()]
        floor = [clause[2:] for clause in clauses if clause.startswith(">=")]
        exact = [clause[2:] for clause in clauses if clause.startswith("==")]
        if exact:
            pins.append(f"{name}=={exact[0]}")
        elif floor:
            pins.append(f"{name}=={floor[0]}")
        else:
            raise SystemExit(f"{requirement!r} declares no floor (>=): every runtime dependency must")
    return pins


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    print("\n".join(floors(root / "pyproject.toml")))
    sys.exit(0)
