"""Print pip constraints that pin every direct dependency to the floor pyproject.toml states.

    python3 .ci/floors.py demo redis test > constraints.txt
    pip install -c constraints.txt -e '.[demo,redis,test]'

Each `name>=X` among the runtime dependencies and the named extras becomes `name==X`
(markers kept), so an install resolves to the oldest versions we claim to support, and
`make test-lowest` proves the claim. A dependency without a `>=` floor is an error: the
claim would be unbounded below and this job could not check it.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*?)\s*(;.*)?$")
_FLOOR = re.compile(r">=\s*([^,\s]+)")


def floors(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) {unknown}; pyproject.toml has {sorted(optional)}")
    requirements = list(project["dependencies"]) + [r for e in extras for r in optional[e]]
    pins: dict[str, str] = {}
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        floor = _FLOOR.search(match.group(2)) if match else None
        if match is None or floor is None:
            raise SystemExit(f"{requirement!r} has no '>=' floor: give it one so the lowest-versions job can pin it")
        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
        pin = f"{name}=={floor.group(1)}{match.group(3) or ''}"
        if pins.setdefault(name, pin) != pin:
            raise SystemExit(f"{name} has two floors ({pins[name]!r} and {pin!r}): give it one")
    return [pins[name] for name in sorted(pins)]


def main() -> None:
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    print("\n".join(floors(pyproject, sys.argv[1:])))


if __name__ == "__main__":
    main()
