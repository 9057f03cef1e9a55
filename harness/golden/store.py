"""The golden store: `<root>/<hw>/<suite>/<case>.json` plus `<case>.meta.json`, and exact values
per numerics fingerprint in `<case>.exact/<fingerprint id>.json` (+ `.meta.json`).

The case's json is the *reference*: the values the approximate lane compares with, and the exact
values of the fingerprint that recorded them (`numerics` in its meta). Another machine's exact
values (`GoldenStore.write_exact`, `mhc-harness recalibrate --exact-only`) go into the
`.exact` directory, each tied to the reference it was recorded beside (`reference_sha256`): when
the reference is rewritten, `GoldenStore.write` drops the sets recorded against the old one.

Writes are atomic and locked. `GoldenStore.write` validates everything first (names,
finiteness, meta), then takes `fcntl.flock` on `.<case>.lock` next to the case, writes both
files to temporary files in the same directory, fsyncs them, and `os.replace`-s the json and
then the meta, all under that one lock. A writer killed at any point leaves either the old
pair or the new pair (or, if killed between the two replaces, a meta whose `golden_sha256`
no longer matches, which every read reports as `MetaError`); its temp
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

from harness.golden.errors import GoldenFormatError, LockTimeoutError, MetaError, MissingGoldenError
from harness.golden.hardware import validate_hw_key
from harness.golden.provenance import git_commit, package_versions, utc_now
from harness.golden.schema import Golden, dumps_golden, golden_digest, load_golden, parse_json

__all__ = [
    "EXACT_META_REQUIRED",
    "META_REQUIRED",
    "ExactSet",
    "PAUSE_ENV_VAR",
    "CaseFiles",
    "GoldenStore",
    "build_meta",
    "numerics_entry",
    "recalibrate_command",
    "validate_meta",
    "validate_name",
]

PAUSE_ENV_VAR = "MHC_HARNESS_TEST_PAUSE_AFTER_TMP"
"""Test hook: seconds a writer sleeps after writing its temp files, before replacing (crash tests)."""

META_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "hardware": str,
    "suite": str,
    "case": str,
    "date": str,
    "source": str,
    "repeats": int,
    "versions": dict,
    "git_commit": (str, type(None)),
    "spread": dict,
    "golden_sha256": str,
}
"""Keys every meta file has, with their JSON types (`numerics`, the recording fingerprint, is optional:
a meta written before fingerprints, or by hand, has none, and its exact values apply nowhere)."""

EXACT_META_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "hardware": str,
    "suite": str,
    "case": str,
    "date": str,
    "source": str,
    "repeats": int,
    "versions": dict,
    "git_commit": (str, type(None)),
    "numerics": dict,
    "reference_sha256": str,
    "golden_sha256": str,
}
"""Keys every exact set's meta file has: `reference_sha256` is the digest of the case's json the set
was recorded beside."""

_FP_ID_RE = re.compile(r"^[0-9a-f]{12}$")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")


def validate_name(value: str, *, field: str) -> str:
    """Return `value` if usable as a suite or case name (one path component), else `ValueError`."""
    if not isinstance(value, str) or not _NAME_RE.match(value) or ".." in value:
        raise ValueError(
            f"{field}={value!r} must be one path component of letters, digits, '_', '.', '+', '-'"
        )
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

    @property
    def exact_dir(self) -> Path:
        """`<case>.exact/`: exact values of fingerprints other than the reference's."""
        return self.directory / f"{self.case}.exact"

    def exact_json(self, fingerprint_id: str) -> Path:
        return self.exact_dir / f"{_fp_id(fingerprint_id)}.json"

    def exact_meta(self, fingerprint_id: str) -> Path:
        return self.exact_dir / f"{_fp_id(fingerprint_id)}.meta.json"


def _fp_id(value: str) -> str:
    if not isinstance(value, str) or not _FP_ID_RE.match(value):
        raise ValueError(f"fingerprint id {value!r} must be 12 lowercase hex digits (NumericsFingerprint.id)")
    return value


@dataclass(frozen=True, kw_only=True)
class ExactSet:
    """Exact values of one fingerprint beside a case's reference."""

    fingerprint_id: str
    label: str
    golden: Golden
    meta: dict[str, Any]

    @property
    def reference_sha256(self) -> str:
        return self.meta["reference_sha256"]


def numerics_entry(fingerprint: Any) -> dict[str, Any]:
    """The meta's `numerics` object for a `NumericsFingerprint`."""
    return {"id": fingerprint.id, "label": fingerprint.label, "fingerprint": fingerprint.to_json()}


def _validate_numerics(doc: Any, *, source: str) -> None:
    from harness.golden.fingerprint import fingerprint_from_json

    if not isinstance(doc, dict) or not {"id", "label", "fingerprint"} <= set(doc):
        raise MetaError(
            f"{source}: numerics must be an object with id, label and fingerprint, got {doc!r:.200}"
        )
    if not isinstance(doc["id"], str) or not _FP_ID_RE.match(doc["id"]) or not isinstance(doc["label"], str):
        raise MetaError(
            f"{source}: numerics.id={doc['id']!r} must be 12 hex digits and numerics.label a string"
        )
    try:
        fingerprint_from_json(doc["fingerprint"], source=f"{source}: numerics.fingerprint")
    except GoldenFormatError as exc:
        raise MetaError(str(exc)) from None


def validate_meta(doc: Any, *, source: str, golden: Golden | None = None) -> dict[str, Any]:
    """Check a parsed meta document; with `golden`, also that it describes exactly those values."""
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
    if doc.get("numerics") is not None:
        _validate_numerics(doc["numerics"], source=source)
    if golden is not None and doc["golden_sha256"] != golden_digest(golden):
        raise MetaError(
            f"{source}: golden_sha256 {doc['golden_sha256'][:12]}... does not match the golden file "
            f"({golden_digest(golden)[:12]}...): the pair is out of sync (edited by hand or an interrupted "
            "write); recalibrate the case or delete the meta file"
        )
    return doc


def validate_exact_meta(doc: Any, *, source: str, golden: Golden) -> dict[str, Any]:
    """Check an exact set's meta document against its values (see `EXACT_META_REQUIRED`)."""
    if not isinstance(doc, dict):
        raise MetaError(f"{source}: expected a JSON object, got {type(doc).__name__}")
    missing = sorted(k for k in EXACT_META_REQUIRED if k not in doc)
    if missing:
        raise MetaError(f"{source}: partial meta file of an exact set, missing keys {missing}")
    for key, typ in EXACT_META_REQUIRED.items():
        if not isinstance(doc[key], typ) or isinstance(doc[key], bool):
            raise MetaError(f"{source}: key {key!r} has {type(doc[key]).__name__} value {doc[key]!r}")
    _validate_numerics(doc["numerics"], source=source)
    if doc["golden_sha256"] != golden_digest(golden):
        raise MetaError(
            f"{source}: golden_sha256 {doc['golden_sha256'][:12]}... does not match its values "
            f"({golden_digest(golden)[:12]}...): the exact set is out of sync; re-add it with "
            "mhc-harness recalibrate --exact-only, or delete both files"
        )
    return doc


def build_meta(
    *,
    hw: str,
    suite: str,
    case: str,
    golden: Golden,
    source: str,
    repeats: int = 1,
    spread: Mapping[str, Any] | None = None,
    hw_rule: str | None = None,
    commit_cwd: str | Path | None = None,
    numerics: Any = None,
) -> dict[str, Any]:
    """Provenance for a case: hardware, versions, commit, date, repeats, spread, content digest, and
    `numerics` (`numerics_entry` of the recording fingerprint) when `numerics` is given."""
    meta = {
        "hardware": hw,
        "hardware_rule": hw_rule,
        "suite": suite,
        "case": case,
        "date": utc_now(),
        "source": source,
        "repeats": repeats,
        "versions": package_versions(),
        "git_commit": git_commit(commit_cwd),
        "spread": dict(spread or {}),
        "golden_sha256": golden_digest(golden),
    }
    if numerics is not None:
        meta["numerics"] = numerics_entry(numerics)
    return meta


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
                    raise LockTimeoutError(
                        f"{path}: lock held by another writer for more than {timeout_s:.0f} s"
                    ) from None
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
    """Golden files of every hardware key under one root directory (`golden/`)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def files(self, hw: str, suite: str, case: str) -> CaseFiles:
        """The paths of a case; names are validated (`ValueError` naming the field)."""
        return CaseFiles(
            root=self.root,
            hw=validate_hw_key(hw),
            suite=validate_name(suite, field="suite"),
            case=validate_name(case, field="case"),
        )

    def hardware_keys(self, suite: str, case: str) -> list[str]:
        """Hardware keys that have a golden file for this case, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(
            d.name
            for d in self.root.iterdir()
            if not d.name.startswith(".") and (d / suite / f"{case}.json").is_file()
        )

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
        doc = _read_meta(f.meta) if f.meta.exists() else None
        return golden, (None if doc is None else validate_meta(doc, source=str(f.meta), golden=golden))

    def exact_sets(self, hw: str, suite: str, case: str) -> list[ExactSet]:
        """The case's exact sets (`<case>.exact/`), sorted by fingerprint id; a broken one is an error."""
        f = self.files(hw, suite, case)
        if not f.exact_dir.is_dir():
            return []
        out = []
        for path in sorted(f.exact_dir.glob("*.meta.json")):
            fp_id = path.name.removesuffix(".meta.json")
            values = f.exact_dir / f"{fp_id}.json"
            if not _FP_ID_RE.match(fp_id):
                raise MetaError(
                    f"{path}: not an exact set's meta file (the name must be <12 hex digits>.meta.json)"
                )
            if not values.is_file():
                raise MetaError(
                    f"{path}: its values {values.name} are missing; re-add the set with "
                    "mhc-harness recalibrate --exact-only, or delete the meta file"
                )
            golden = load_golden(values)
            meta = validate_exact_meta(_read_meta(path), source=str(path), golden=golden)
            if meta["numerics"]["id"] != fp_id:
                raise MetaError(
                    f"{path}: numerics.id {meta['numerics']['id']!r} is not its file name's {fp_id!r}"
                )
            out.append(
                ExactSet(fingerprint_id=fp_id, label=meta["numerics"]["label"], golden=golden, meta=meta)
            )
        orphans = sorted(
            p.name
            for p in f.exact_dir.glob("*.json")
            if not p.name.endswith(".meta.json") and not (f.exact_dir / f"{p.stem}.meta.json").is_file()
        )
        if orphans:
            raise MetaError(f"{f.exact_dir}: exact values without a meta file: {', '.join(orphans)}")
        return out

    def write(
        self,
        hw: str,
        suite: str,
        case: str,
        golden: Golden,
        meta: Mapping[str, Any],
        *,
        lock_timeout_s: float = 120.0,
    ) -> CaseFiles:
        """Atomically write the reference `golden` and `meta` under the case lock (module docstring);
        exact sets recorded against another reference are removed under the same lock."""
        f = self.files(hw, suite, case)
        text = dumps_golden(golden, target=str(f.json))
        meta_doc = dict(meta, golden_sha256=golden_digest(golden))
        validate_meta(meta_doc, source=f"meta for {f.json}", golden=golden)
        meta_text = _meta_text(meta_doc, target=f.json)
        with self._locked(f, lock_timeout_s, (f.json, f.meta)):
            _replace_pair(f.directory, (f.json, text), (f.meta, meta_text))
            if f.exact_dir.is_dir():
                for p in f.exact_dir.glob("*.meta.json"):
                    try:
                        ref = json.loads(p.read_text(encoding="utf-8")).get("reference_sha256")
                    except (OSError, ValueError, AttributeError):
                        ref = None
                    if ref != meta_doc["golden_sha256"]:
                        p.unlink(missing_ok=True)
                        (f.exact_dir / p.name.replace(".meta.json", ".json")).unlink(missing_ok=True)
                _fsync_dir(f.exact_dir)
        return f

    def write_exact(
        self,
        hw: str,
        suite: str,
        case: str,
        golden: Golden,
        meta: Mapping[str, Any],
        *,
        lock_timeout_s: float = 120.0,
    ) -> Path:
        """Atomically add (or replace) the exact values of `meta["numerics"]`'s fingerprint beside the
        reference, under the case lock; the reference and the other sets are left as they are.
        `meta["reference_sha256"]` must be the current reference's digest. Returns the json path."""
        f = self.files(hw, suite, case)
        fp_id = _fp_id((meta.get("numerics") or {}).get("id", ""))
        target = f.exact_json(fp_id)
        text = dumps_golden(golden, target=str(target))
        meta_doc = dict(meta, golden_sha256=golden_digest(golden))
        validate_exact_meta(meta_doc, source=f"meta for {target}", golden=golden)
        meta_text = _meta_text(meta_doc, target=target)
        with self._locked(f, lock_timeout_s, (target, f.exact_meta(fp_id))):
            reference, ref_meta = self.load(
                hw, suite, case
            )  # under the lock: the reference cannot move meanwhile
            if golden_digest(reference) != meta_doc["reference_sha256"]:
                raise MetaError(
                    f"{f.json}: the reference changed (sha256 {golden_digest(reference)[:12]}..., the "
                    f"exact set was recorded beside {meta_doc['reference_sha256'][:12]}...); nothing written"
                )
            if ref_meta and (ref_meta.get("numerics") or {}).get("id") == fp_id:
                raise MetaError(
                    f"{f.json}: fingerprint {fp_id} recorded the reference itself; its exact values are "
                    "the reference, so no exact set is written for it"
                )
            f.exact_dir.mkdir(exist_ok=True)
            _replace_pair(f.exact_dir, (target, text), (f.exact_meta(fp_id), meta_text))
        return target

    @contextmanager
    def _locked(self, f: CaseFiles, timeout_s: float, targets: tuple[Path, ...]) -> Iterator[None]:
        f.directory.mkdir(parents=True, exist_ok=True)
        for target in targets:  # checked before anything is replaced: a half-written case is worse
            if target.exists() and not target.is_file():
                raise GoldenFormatError(f"{target}: exists and is not a regular file; nothing written")
        with _flock(f.lock, timeout_s):
            yield


def _read_meta(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MetaError(f"{path}: unreadable ({exc})") from None
    if not text.strip():
        raise MetaError(f"{path}: empty meta file (partial write?)")
    try:
        return parse_json(text, source=str(path))
    except ValueError as exc:
        raise MetaError(str(exc)) from None


def _meta_text(doc: Mapping[str, Any], *, target: Path) -> str:
    try:
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"
    except ValueError as exc:
        raise MetaError(f"meta for {target}: {exc}") from None


def _fsync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _replace_pair(directory: Path, first: tuple[Path, str], second: tuple[Path, str]) -> None:
    """Write both texts to temp files in `directory`, fsync, then replace the first and the second
    target (the caller holds the case lock); stale temp files of a killed writer are removed first."""
    names = "|".join(re.escape(t.name) for t, _ in (first, second))
    stale = re.compile(rf"^\.(?:{names})\.[A-Za-z0-9_]{{8}}\.tmp$")
    for leftover in directory.iterdir():
        if stale.match(leftover.name):  # from a writer killed before its replace
            leftover.unlink(missing_ok=True)
    tmp_first = _write_tmp(directory, first[0].name, first[1])
    try:
        tmp_second = _write_tmp(directory, second[0].name, second[1])
    except BaseException:
        tmp_first.unlink(missing_ok=True)
        raise
    try:
        if os.environ.get(PAUSE_ENV_VAR):
            time.sleep(float(os.environ[PAUSE_ENV_VAR]))
        os.replace(tmp_first, first[0])
        os.replace(tmp_second, second[0])
    finally:
        tmp_first.unlink(missing_ok=True)
        tmp_second.unlink(missing_ok=True)
    _fsync_dir(directory)
