"""The installed genai-prices' rows, as the proxy loads them: compiled in a process of its
own, once per genai-prices version and day, and kept in a cache file.

Importing genai-prices' data builds ~2,300 models (~0.2 s, ~6 MB a serving process would
keep for its life, on top of the compiled rows it needs). So the data is compiled by
`python -m proxy.pricing.bundled` and read back as JSON; the result is written to
`$SPANMETER_CACHE_DIR` (default `$XDG_CACHE_HOME/spanmeter`, `~/.cache/spanmeter`), keyed by
the genai-prices version, the day and this compiler's own code, so a later start reads ~1 ms
of JSON. Whatever fails on the way (no cache dir, a child that cannot start) falls back to
compiling in process: slower, never wrong.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
from datetime import date
from pathlib import Path

from proxy.pricing.source import PriceSource

__all__ = ["bundled", "cache_dir"]

log = logging.getLogger("spanmeter.pricing")
_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the proxy package
_CHILD_TIMEOUT_S = 120.0
# The code that decides what a cached row holds: a change to any of it compiles anew.
_COMPILER_FILES = ("compiler.py", "source.py", "row.py", "bundled.py")


def bundled(today: date | None = None) -> PriceSource:
    """genai-prices' rows for `today` (once per process and day)."""
    return _bundled(today or date.today())


def cache_dir() -> Path:
    explicit = os.environ.get("SPANMETER_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spanmeter"


@functools.lru_cache(maxsize=2)
def _bundled(today: date) -> PriceSource:
    path = cache_dir() / f"prices-{_key(today)}.json"
    try:
        return PriceSource.from_json(json.loads(path.read_bytes()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        log.warning("the compiled price cache %s is unreadable; compiling genai-prices' data again", path)
    doc = _compile_apart(today)
    compiled = PriceSource.from_json(doc) if doc is not None else _compile_here(today)
    _store(path, compiled if doc is None else doc)
    return compiled


def _compile_here(today: date) -> PriceSource:
    from proxy.pricing.compiler import compile_installed  # genai-prices' data: here only when the child failed

    return compile_installed(today)


def _key(today: date) -> str:
    """genai-prices' version, the day (prices take effect by date) and the compiler's code."""
    version = importlib.metadata.version("genai-prices")
    here = Path(__file__).parent
    code = hashlib.sha256(b"".join((here / f).read_bytes() for f in _COMPILER_FILES)).hexdigest()[:12]
    return f"{version}-{today.isoformat()}-{code}"


def _compile_apart(today: date) -> dict[str, object] | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(_ROOT), os.environ.get("PYTHONPATH"))))}
    try:
        done = subprocess.run([sys.executable, "-m", "proxy.pricing.bundled", today.isoformat()], env=env,
                              capture_output=True, timeout=_CHILD_TIMEOUT_S, check=True)
        doc = json.loads(done.stdout)
        return doc if isinstance(doc, dict) else None
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("compiling genai-prices' data in a process of its own failed (%s); compiling it here", exc)
        return None


def _store(path: Path, compiled: PriceSource | dict[str, object]) -> None:
    doc = compiled.to_json() if isinstance(compiled, PriceSource) else compiled
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
        tmp.replace(path)  # atomic: a concurrent start reads the old file or the new, never half
        for old in path.parent.glob("prices-*.json"):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError as exc:
        log.info("could not keep the compiled prices in %s (%s): each start compiles them", path.parent, exc)


if __name__ == "__main__":
    json.dump(_compile_here(date.fromisoformat(sys.argv[1])).to_json(), sys.stdout,
              separators=(",", ":"))
