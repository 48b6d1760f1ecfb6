"""A model version folder's `SHA256SUMS`: each graph the model loads and its sha256 as the build's
report recorded it, in the format `sha256sum -c` reads. The repository writes it
(serving/triton/repository.py); the Python models check every graph their parameters name against it
before they open one (serving/triton/engines.py), so a file changed after the build fails the load
with the reason instead of being served.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from contract.files import DIGESTS_FILENAME, sha256

_LINE = re.compile(r"(?P<digest>[0-9a-f]{64}) [ *](?P<name>.+)")  # sha256sum's text and binary forms
REWRITE = "build the artifact and write the repository again (python -m serving repository, or ensure)"


class IntegrityError(RuntimeError):
    """A model file is not the one its build checked: changed, or with no digest to compare."""


def write(version: Path, digests: Mapping[str, str]) -> Path:
    """`SHA256SUMS` in `version`: file name -> hex digest."""
    path = version / DIGESTS_FILENAME
    path.write_text("".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items())))
    return path


def read(version: Path) -> dict[str, str]:
    """File name -> digest, from the version folder's `SHA256SUMS`."""
    path = version / DIGESTS_FILENAME
    if not path.is_file():
        raise IntegrityError(f"{path} is missing, so the model's files cannot be checked; {REWRITE}")
    digests = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        found = _LINE.fullmatch(line)
        if found is None:
            raise IntegrityError(f"{path}, line {number}: expected '<sha256>  <file name>', got {line!r}")
        digests[found["name"]] = found["digest"]
    return digests


def verify(version: Path, names: Iterable[str]) -> None:
    """Each named file in `version` has the digest `SHA256SUMS` records for it, else IntegrityError
    naming the file, the recorded and the actual digest."""
    recorded = read(version)
    for name in sorted(set(names)):
        path = (version / name).resolve()  # the user's file: Triton serves links to it (serving/host/launcher.py)
        expected = recorded.get(name)
        if expected is None:
            raise IntegrityError(f"{path}: no sha256 recorded for it in {DIGESTS_FILENAME}; {REWRITE}")
        changed = changed_since_build(path, expected)
        if changed:
            raise IntegrityError(f"{changed}; refusing to serve it: {REWRITE}")


def changed_since_build(path: Path, recorded: str) -> str | None:
    """What to say when `path` no longer has the sha256 its build recorded; None when it has it."""
    actual = sha256(path)
    if actual == recorded:
        return None
    return f"{path} changed after its build: sha256 {actual}, the build recorded {recorded}"
