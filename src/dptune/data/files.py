"""Locating, verifying and downloading dataset files: ``<data_dir>/<name>/`` (argument, else ``$DPTUNE_DATA_DIR``), else
the cache ``<cache_dir>/<name>/``, else a download into it (``$DPTUNE_DOWNLOAD_TIMEOUT``, ``$DPTUNE_OFFLINE=1``). Each
file is checked against the registry; a passed check is kept in ``<cache_dir>/verified.json`` (path, size, mtimes)."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import os
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from dptune.data.registry import DatasetSpec, FileSpec
from dptune.errors import DataError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
_CHUNK = 1 << 20


def data_root(data_dir: str | os.PathLike[str] | None) -> Path | None:
    """``data_dir`` argument, else ``$DPTUNE_DATA_DIR``, else ``None``."""
    value = data_dir if data_dir is not None else os.environ.get("DPTUNE_DATA_DIR") or None
    return Path(value).expanduser() if value is not None else None


def cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``cache_dir`` argument, else ``$DPTUNE_CACHE``, else the user cache folder."""
    value = cache_dir if cache_dir is not None else os.environ.get("DPTUNE_CACHE") or None
    if value is not None:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dptune"


def file_digests(path: Path) -> tuple[str, str]:
    """SHA-256 and MD5 of a file, in one pass."""
    sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            sha.update(chunk)
            md5.update(chunk)
    return sha.hexdigest(), md5.hexdigest()


# <cache>/verified.json: path -> (size, mtime_ns, ctime_ns, sha256) of the files that passed a check.
def _verified(cache: Path) -> dict[str, dict[str, object]]:
    try:
        with open(cache / "verified.json", encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _stamp(path: Path) -> tuple[str, dict[str, object]]:
    st = path.stat()
    # ctime too: a write that restores the size and mtime (touch -d) still changes it
    return str(path.resolve()), {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _record_verified(cache: Path, path: Path, digest: str) -> None:
    key, stamp = _stamp(path)
    data = {**_verified(cache), key: {**stamp, "digest": digest}}
    target = cache / "verified.json"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=0, sort_keys=True)
        os.replace(tmp, target)
    except OSError as exc:  # a read-only cache only costs re-hashing next time
        log.debug("could not record verification in %s: %s", target, exc)


def verify_file(path: Path, spec: FileSpec, cache: Path, dataset: str, *, fix: str | None = None) -> None:
    """Raise ``DataError`` unless ``path`` matches the registry checksum of ``spec``."""
    if spec.sha256 or spec.alt_sha256:
        algo, accepted = "sha256", tuple(h for h in (spec.sha256, *spec.alt_sha256) if h)
    else:  # md5 when that is all that is known
        algo, accepted = "md5", ((spec.md5,) if spec.md5 else ())
    if not accepted:
        log.warning("dptune.data: no published checksum for %s (dataset %r); it was read unverified.", path, dataset)
        return
    key, stamp = _stamp(path)
    if _verified(cache).get(key) in [{**stamp, "digest": h} for h in accepted]:
        return  # as ``_record_verified`` wrote it: the same file
    try:
        sha, md5 = file_digests(path)
    except OSError as exc:
        raise DataError(f"dataset {dataset!r}: cannot read {path}: {exc}") from exc
    actual = sha if algo == "sha256" else md5
    if actual not in accepted:
        fix = fix or (
            f"delete it and load again to re-download it, or replace it with an intact copy "
            f"from {spec.urls[0] if spec.urls else 'the original source'}"
        )
        raise DataError(
            f"dataset {dataset!r}: checksum mismatch for {path}\n"
            f"  expected {algo} {accepted[0]}\n"
            f"  actual   {algo} {actual}\n"
            f"The file is corrupted, truncated or a different version. Fix: {fix}. "
            "(Pass verify=False to load() to skip the check at your own risk.)"
        )
    _record_verified(cache, path, actual)


def _fetch(url: str, dest: Path, timeout: float) -> None:
    """Download ``url`` to ``dest`` atomically (a part file of this process and thread, then rename: two ranks
    downloading at once truncated one shared part file, and both failed; found in review)."""
    part = dest.with_name(f"{dest.name}.{os.getpid()}.{threading.get_ident()}.part")
    req = urllib.request.Request(url, headers={"User-Agent": "dptune (python urllib)"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp, open(part, "wb") as out:
            shutil.copyfileobj(resp, out, _CHUNK)
        os.replace(part, dest)
    finally:
        with contextlib.suppress(OSError):
            part.unlink()


def download_file(spec: FileSpec, dest: Path, cache: Path, dataset: str) -> list[str]:
    """Try each URL of ``spec``; return the failure messages (empty list on success)."""
    if os.environ.get("DPTUNE_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
        return ["downloads disabled by DPTUNE_OFFLINE"]
    try:
        timeout = float(os.environ.get("DPTUNE_DOWNLOAD_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        timeout = DEFAULT_TIMEOUT_S
    failures: list[str] = []
    dest.parent.mkdir(parents=True, exist_ok=True)
    for url in spec.urls:
        log.info("dptune.data: downloading %s -> %s", url, dest)
        try:
            _fetch(url, dest, timeout)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:  # a non-HTTP reply too
            failures.append(f"{url}: {type(exc).__name__}: {exc}")
            continue
        try:
            verify_file(dest, spec, cache, dataset)
        except DataError as exc:
            with contextlib.suppress(OSError):
                dest.unlink()
            failures.append(f"{url}: downloaded file failed verification ({exc})")
            continue
        return []
    return failures


def resolve(
    spec: DatasetSpec,
    variants: tuple[str, ...],
    *,
    data_dir: str | os.PathLike[str] | None,
    cache_dir: str | os.PathLike[str] | None,
    verify: bool = True,
) -> tuple[str, dict[str, Path]]:
    """Find (or download) one complete, verified variant; return (variant, name -> path)."""
    root = data_root(data_dir)
    cache = cache_root(cache_dir)
    folders = [root / spec.name] if root is not None else []
    for folder in [*folders, cache / spec.name]:
        for v in variants:
            files = spec.variants[v]
            if all((folder / f.name).is_file() for f in files):
                paths = {f.name: folder / f.name for f in files}
                if verify:
                    for f in files:
                        verify_file(paths[f.name], f, cache, spec.name, fix=_local_fix(f, folder))
                return v, paths

    # Nothing complete locally: download the first variant that has URLs.
    failures: list[str] = []
    chosen = next((v for v in variants if all(f.urls for f in spec.variants[v])), None)
    if chosen is not None:
        paths = {f.name: cache / spec.name / f.name for f in spec.variants[chosen]}
        for f in spec.variants[chosen]:
            if paths[f.name].is_file():
                if verify:
                    verify_file(paths[f.name], f, cache, spec.name)
                continue
            failures += download_file(f, paths[f.name], cache, spec.name)
            if not paths[f.name].is_file():
                break
        else:
            return chosen, paths
    raise DataError(_missing_message(spec, variants, root, cache, failures))


def _local_fix(f: FileSpec, folder: Path) -> str:
    src = f.urls[0] if f.urls else "the original source (see docs/data_and_models.md)"
    return (
        f"replace {folder / f.name} with an intact copy from {src} "
        "(if it is in the download cache, simply delete it and load again)"
    )


def _missing_message(
    spec: DatasetSpec, variants: tuple[str, ...], root: Path | None, cache: Path, failures: list[str]
) -> str:
    lines = [f"dataset {spec.name!r} is not available locally and could not be downloaded."]
    if root is not None:
        lines.append(f"Looked in data_dir {root / spec.name} and in the cache {cache / spec.name}.")
    else:
        lines.append(f"Looked in the cache {cache / spec.name} (no data_dir / DPTUNE_DATA_DIR set).")
    if failures:
        lines.append("Download attempts:")
        lines += [f"  - {m}" for m in failures]
    lines.append("Fix: put the files there yourself, e.g. one of these sets:")
    for v in variants:
        for f in spec.variants[v]:
            digest = f.sha256 or (f"md5 {f.md5}" if f.md5 else "checksum unknown")
            src = ", ".join(f.urls) if f.urls else "no public URL (shared-data format)"
            lines.append(f"  [{v}] {cache / spec.name / f.name}  <- {src}  ({digest})")
    lines.append(
        f"or place them under <DIR>/{spec.name}/ and set DPTUNE_DATA_DIR=<DIR> "
        "(or pass data_dir=<DIR> to dptune.data.load)."
    )
    return "\n".join(lines)


@contextlib.contextmanager
def reading(path: Path, dataset: str) -> Iterator[None]:
    """Turn any parse failure while reading ``path`` into a ``DataError`` naming the fix."""
    try:
        yield
    except DataError:
        raise
    except FileNotFoundError as exc:  # not a corrupt file (found in review: "delete it" of a missing file)
        raise DataError(f"dataset {dataset!r}: {path} does not exist. Fix: set DPTUNE_DATA_DIR to the folder holding "
                        f"{dataset}/, or load it with dptune.data.load (it downloads).") from exc  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - any parse failure means a bad file
        raise DataError(
            f"dataset {dataset!r}: could not read {path}: the file is corrupted or truncated "
            f"({type(exc).__name__}: {exc}). Fix: delete it and load again to re-download it "
            "(or replace your local copy with an intact one)."
        ) from exc
