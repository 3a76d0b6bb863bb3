"""requirements-lock.txt (scripts/lock.sh) covers pyproject.toml: every dependency of beatflow and of its
tests is pinned there, at a version its range admits, with hashes, so scripts/setup.sh installs what CI tested."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _locked() -> dict[str, tuple[Version, list[str]]]:
    text = (ROOT / "requirements-lock.txt").read_text()
    out = {}
    for block in re.split(r"\n(?=\S)", text):
        m = re.match(r"([A-Za-z0-9_.\-]+)==(\S+)", block)
        if m:
            out[canonicalize_name(m[1])] = (Version(m[2]), re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return out


def test_every_dependency_is_locked_in_range_with_hashes():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in meta["dependencies"] + meta["optional-dependencies"]["test"]]
    locked = _locked()
    assert len(locked) > 100
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is not in requirements-lock.txt: run bash scripts/lock.sh"
        version, hashes = locked[name]
        assert req.specifier.contains(version, prereleases=True), f"{req} but the lock has {version}"
        assert hashes, f"{req.name} has no hash in the lock"
    for name, (_, hashes) in locked.items():
        assert hashes, f"{name} has no hash in the lock"


def test_torch_is_the_cpu_build():
    version, _ = _locked()["torch"]
    assert version.local == "cpu", version
