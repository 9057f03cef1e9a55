"""The golden store: ``<root>/<hw>/<suite>/<case>.json`` plus ``<case>.meta.json``.

Writes are atomic and locked. :meth:`GoldenStore.write` validates everything first (names,
finiteness, meta), then takes ``fcntl.flock`` on ``.<case>.lock`` next to the case, writes both
files to temporary files in the same directory, fsyncs them, and ``os.replace``-s the json and
then the meta, all under that one lock. A writer killed at any point leaves either the old
pair or the new pair (or, if killed between the two replaces, a meta whose ``golden_sha256``
no longer matches, which every read reports as :class:`~harness.errors.MetaError`); its temp
files are hidden, uniquely named, and removed by the next writer of that case.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import GoldenFormatError, LockTimeoutError, MetaError, MissingGoldenError
from harness.hardware import validate_hw_key
from harness.provenance import git_commit, package_versions, utc_now
from harness.schema import Golden, dumps_golden, golden_digest, load_golden, parse_json

__all__ = [
    "META_REQUIRED",
    "PAUSE_ENV_VAR",
    "CaseFiles",
    "GoldenStore",
    "build_meta",
    "recalibrate_command",
    "validate_meta",
    "validate_name",
]

PAUSE_ENV_VAR = "MHC_HARNESS_TEST_PAUSE_AFTER_TMP"
"""Test hook: seconds a writer sleeps after writing its temp files, before replacing (crash tests)."""

META_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "hardware": str, "suite": str, "case": str, "date": str, "source": str, "repeats": int,
    "versions": dict, "git_commit": (str, type(None)), "spread": dict, "golden_sha256": str,
}
"""Keys every meta file has, with their JSON types."""

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")


def validate_name(value: str, *, field: str) -> str:
    """Return ``value`` if usable as a suite or case name (one path component), else ``ValueError``."""
    if not isinstance(value, str) or not _NAME_RE.match(value) or ".." in value:
        raise ValueError(f"{field}={value!r} must be one path component of letters, digits, '_', '.', '+', '-'")
    return value


def recalibrate_command(suite: str, case: str, hw: str, repeats: int = 5) -> str:
    """The exact command that creates or refreshes a case's golden values."""
    return f"mhc-harness recalibrate {suite} {case} --hw {hw} --repeats {repeats}"


@dataclass(frozen=True, kw_only=True)
class CaseFiles:
    """The paths of one case on one hardware key."""

    root: Path
    hw: str
    suite: str
    case: str

    @property
    def directory(self) -> Path:
        return self.root / self.hw / self.suite

    @property
    def json(self) -> Path:
        return self.directory / f"{self.case}.json"

    @property
    def meta(self) -> Path:
        return self.directory / f"{self.case}.meta.json"

    @property
    def lock(self) -> Path:
        return self.directory / f".{self.case}.lock"


def validate_meta(doc: Any, *, source: str, golden: Golden | None = None) -> dict[str, Any]:
    """Check a parsed meta document; with ``golden``, also that it describes exactly those values."""
    if not isinstance(doc, dict):
        raise MetaError(f"{source}: expected a JSON object, got {type(doc).__name__}")
    missing = sorted(k for k in META_REQUIRED if k not in doc)
    if missing:
        raise MetaError(f"{source}: partial meta file, missing keys {missing}")
    for key, typ in META_REQUIRED.items():
        if not isinstance(doc[key], typ) or isinstance(doc[key], bool):
            raise MetaError(f"{source}: key {key!r} has {type(doc[key]).__name__} value {doc[key]!r}")
    if doc["repeats"] < 1:
        raise MetaError(f"{source}: repeats={doc['repeats']} must be >= 1")
    if golden is not None and doc["golden_sha256"] != golden_digest(golden):
        raise MetaError(
            f"{source}: golden_sha256 {doc['golden_sha256'][:12]}... does not match the golden file "
            f"({golden_digest(golden)[:12]}...): the pair is out of sync (edited by hand or an interrupted "
            "write); recalibrate the case or delete the meta file"
        )
    return doc


def build_meta(*, hw: str, suite: str, case: str, golden: Golden, source: str, repeats: int = 1,
               spread: Mapping[str, Any] | None = None, hw_rule: str | None = None,
               commit_cwd: str | Path | None = None) -> dict[str, Any]:
    """Provenance for a case: hardware, versions, commit, date, repeats, spread, content digest."""
    return {
        "hardware": hw, "hardware_rule": hw_rule, "suite": suite, "case": case, "date": utc_now(),
        "source": source, "repeats": repeats, "versions": package_versions(),
        "git_commit": git_commit(commit_cwd), "spread": dict(spread or {}),
        "golden_sha256": golden_digest(golden),
    }


@contextmanager
def _flock(path: Path, timeout_s: float) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise LockTimeoutError(f"{path}: lock held by another writer for more than {timeout_s:.0f} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def _file_mode(target: Path) -> int:
    """The mode `target` keeps (its current one), or a new file's under the umask (mkstemp's is 0600)."""
    try:
        return target.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _write_tmp(directory: Path, name: str, text: str) -> Path:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _file_mode(directory / name))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


class GoldenStore:
    """Golden files of every hardware key under one root directory (``golden/``)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def files(self, hw: str, suite: str, case: str) -> CaseFiles:
        """The paths of a case; names are validated (``ValueError`` naming the field)."""
        return CaseFiles(root=self.root, hw=validate_hw_key(hw), suite=validate_name(suite, field="suite"),
                         case=validate_name(case, field="case"))

    def hardware_keys(self, suite: str, case: str) -> list[str]:
        """Hardware keys that have a golden file for this case, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(d.name for d in self.root.iterdir()
                      if not d.name.startswith(".") and (d / suite / f"{case}.json").is_file())

    def load(self, hw: str, suite: str, case: str) -> tuple[Golden, dict[str, Any] | None]:
        """Golden values and validated meta (None when there is no meta file) of one case."""
        f = self.files(hw, suite, case)
        if not f.json.is_file():
            have = self.hardware_keys(suite, case)
            raise MissingGoldenError(
                f"no golden values for suite {suite!r} case {case!r} on hardware {hw!r}: {f.json} does not exist. "
                f"Hardware keys with this case: {', '.join(have) if have else '(none)'}. "
                f"Create it with: {recalibrate_command(suite, case, hw)}"
            )
        golden = load_golden(f.json)
        meta = None
        if f.meta.exists():
            try:
                text = f.meta.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise MetaError(f"{f.meta}: unreadable ({exc})") from None
            if not text.strip():
                raise MetaError(f"{f.meta}: empty meta file (partial write?)")
            try:
                doc = parse_json(text, source=str(f.meta))
            except ValueError as exc:
                raise MetaError(str(exc)) from None
            meta = validate_meta(doc, source=str(f.meta), golden=golden)
        return golden, meta

    def write(self, hw: str, suite: str, case: str, golden: Golden, meta: Mapping[str, Any],
              *, lock_timeout_s: float = 120.0) -> CaseFiles:
        """Atomically write ``golden`` and ``meta`` under the case lock (see module docstring)."""
        f = self.files(hw, suite, case)
        text = dumps_golden(golden, target=str(f.json))
        meta_doc = dict(meta, golden_sha256=golden_digest(golden))
        validate_meta(meta_doc, source=f"meta for {f.json}", golden=golden)
        try:
            meta_text = json.dumps(meta_doc, indent=2, allow_nan=False) + "\n"
        except ValueError as exc:
            raise MetaError(f"meta for {f.json}: {exc}") from None
        f.directory.mkdir(parents=True, exist_ok=True)
        for target in (f.json, f.meta):  # checked before anything is replaced: a half-written case is worse
            if target.exists() and not target.is_file():
                raise GoldenFormatError(f"{target}: exists and is not a regular file; nothing written")
        with _flock(f.lock, lock_timeout_s):
            stale = re.compile(rf"^\.(?:{re.escape(f.json.name)}|{re.escape(f.meta.name)})\.[A-Za-z0-9_]{{8}}\.tmp$")
            for leftover in f.directory.iterdir():
                if stale.match(leftover.name):  # from a writer killed before its replace
                    leftover.unlink(missing_ok=True)
            tmp_json = _write_tmp(f.directory, f.json.name, text)
            try:
                tmp_meta = _write_tmp(f.directory, f.meta.name, meta_text)
            except BaseException:
                tmp_json.unlink(missing_ok=True)
                raise
            try:
                if os.environ.get(PAUSE_ENV_VAR):
                    time.sleep(float(os.environ[PAUSE_ENV_VAR]))
                os.replace(tmp_json, f.json)
                os.replace(tmp_meta, f.meta)
            finally:
                tmp_json.unlink(missing_ok=True)
                tmp_meta.unlink(missing_ok=True)
            dfd = os.open(f.directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        return f
