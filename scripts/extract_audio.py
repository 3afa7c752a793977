"""Extract each shard's audio.tar into its shard directory, safely, resumably, in parallel.

Usage:
    python scripts/extract_audio.py --help
    python scripts/extract_audio.py                       # every shard under SHARDS_DIR
    python scripts/extract_audio.py --workers 16 --delete-tars
    SHARDS_DIR=/nvme/shards python scripts/extract_audio.py

For each ``<SHARDS_DIR>/<source>/<lang>/<shard>/`` holding audio.tar and audio_index.parquet:

- Only the members named in audio_index.parquet (``tar_member_name``) are written, each to
  ``<shard dir>/<tar_member_name>``: the path training reads. A member name with subdirectories
  (``a/b.flac``) gets those subdirectories, created inside the shard directory.
- Refused, reported, and the rest of the shard still extracted: absolute names, names with a
  ``..`` component, symlinks, hardlinks, device nodes, fifos and any other non-regular member,
  names that would land on the shard's own files (metadata.parquet, audio_index.parquet,
  audio.tar, the done marker), and anything whose resolved target (following existing symlinked
  directories) lies outside the shard directory. Refused members are never written.
- Each file is written to a hidden temp name in its target directory and renamed into place once
  complete, so a crash never leaves a partial FLAC under a real name; temp files left by a crash
  are deleted on the next run. Files get mode 0644 whatever the tar says.
- Verification: every audio_index member must exist afterwards as a regular file (with the size
  the tar records). Missing ones are reported. Only a verified shard gets its done marker
  (``.extract_done.json``); a rerun skips shards with a marker, so an interrupted run resumes.
  ``--delete-tars`` deletes a tar only after its shard verified (on this run or an earlier one,
  re-checked before deleting).
- A member the tar holds twice is extracted as ``tar -x`` would (the later copy wins: appending is
  how a tar member is updated); when the two copies differ in content, the shard's report lists it.
- Before any work: SHARDS_DIR must take a file, and its file system must have room for the
  pending shards (their tars' size; with ``--delete-tars``, the largest ``--workers`` tars, since
  each tar goes once its shard verifies). ``--no-space-check`` skips the estimate.
- A full disk fails each shard that meets it (its report names the file and says so); the shards
  done before keep their markers, so a rerun after freeing space resumes.

The per-shard report is printed first and then written to
``<SHARDS_DIR>/extract_audio.summary.json``; when that write fails (a full disk) the printed report
is complete and the last line names the file and the cause. The exit status is 1 when any shard is
unverified or failed or the summary could not be written, 2 on bad input (no SHARDS_DIR, no
shards, no room).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import stat
import sys
import tarfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

import polars as pl
from tqdm import tqdm

import config
import file_names
from atomic_files import check_writable, disk_full
from manifest_schema import INDEX_FILE, METADATA_FILE, TAR_FILE, write_json_atomically

DONE_MARKER = ".extract_done.json"
TEMP_PREFIX = ".extract-tmp-"
RESERVED_NAMES = frozenset({METADATA_FILE, INDEX_FILE, TAR_FILE, DONE_MARKER})
MAX_LISTED = 20  # per shard, per kind: the rest is counted
SUMMARY_FILE = "extract_audio.summary.json"


class ExtractError(RuntimeError):
    """Input extract_audio cannot work on (missing SHARDS_DIR, no shards, no room)."""


class DiskFull(OSError):
    """No space left while writing a member: the shard fails with that reason."""


@dataclass
class ShardReport:
    shard_dir: str
    status: str = "pending"  # extracted | skipped_done | failed | unverified
    extracted: int = 0
    refused: list[dict[str, str]] = field(default_factory=list)  # {"member", "reason"}
    refused_count: int = 0
    not_in_index: int = 0  # regular members that audio_index does not list: not written
    missing: list[str] = field(default_factory=list)  # index members absent afterwards
    missing_count: int = 0
    stale_temps_removed: int = 0
    # members of a done shard found missing or resized on a rerun, extracted again from its tar
    reextracted_after_check: int = 0
    # members the tar holds twice with different content: {"member", "sizes"}; the later copy is kept
    conflicting: list[dict] = field(default_factory=list)
    conflicting_count: int = 0
    tar_deleted: bool = False
    error: str = ""


def find_shards(shards_dir: Path) -> list[Path]:
    """Shard directories (holding audio_index.parquet) under ``shards_dir``, sorted."""
    shards_dir = Path(shards_dir)
    if not shards_dir.is_dir():
        raise ExtractError(
            f"SHARDS_DIR {shards_dir} is not a directory: set SHARDS_DIR (or --shards-dir)"
        )
    shards = sorted(p.parent for p in shards_dir.rglob(INDEX_FILE))
    if not shards:
        raise ExtractError(
            f"no shards found under {shards_dir}: expected <source>/<lang>/<shard>/{INDEX_FILE}"
        )
    return shards


def member_problem(member: tarfile.TarInfo) -> str | None:
    """Why ``member`` must not be extracted, judged from the tar header alone (None: fine)."""
    name = member.name
    if member.issym():
        return "symlink"
    if member.islnk():
        return "hardlink"
    if member.ischr() or member.isblk():
        return "device node"
    if member.isfifo():
        return "fifo"
    if not member.isreg():
        return f"not a regular file (tar type {member.type!r})"
    if name.startswith("/") or name.startswith("\\"):
        return "absolute path"
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return "'..' in path"
    return None


def normalized_name(name: str) -> str:
    """A relative member name without ``.`` or empty components (``./a//b`` -> ``a/b``)."""
    return "/".join(p for p in name.replace("\\", "/").split("/") if p not in ("", "."))


def target_path(shard_dir: Path, name: str) -> tuple[Path | None, str | None]:
    """Where ``name`` goes inside ``shard_dir``, or why it may not go anywhere."""
    rel = normalized_name(name)
    if not rel:
        return None, "empty name"
    if (
        rel in RESERVED_NAMES
        or rel.startswith(TEMP_PREFIX)
        or Path(rel).name.startswith(TEMP_PREFIX)
    ):
        return None, "would overwrite the shard's own file"
    root = shard_dir.resolve()
    target = root / rel
    # resolve() follows symlinked directories already on disk: the real parent must stay inside.
    parent = target.parent.resolve()
    if parent != root and root not in parent.parents:
        return None, "resolves outside the shard directory"
    return parent / target.name, None


def remove_stale_temps(shard_dir: Path) -> int:
    """Delete temp files a crashed run left; return how many."""
    removed = 0
    for tmp in shard_dir.rglob(TEMP_PREFIX + "*"):
        if tmp.is_file() and not tmp.is_symlink():
            tmp.unlink()
            removed += 1
    return removed


def read_index(shard_dir: Path) -> list[str]:
    index = pl.read_parquet(shard_dir / INDEX_FILE, columns=["tar_member_name"])
    return [n for n in index.get_column("tar_member_name").cast(pl.String).to_list() if n]


def verify(
    shard_dir: Path, members: Sequence[str], sizes: dict[str, int] | None = None
) -> list[str]:
    """Index members that are not a regular file of the expected size in ``shard_dir``."""
    missing = []
    root = shard_dir.resolve()
    for name in members:
        rel = normalized_name(name)
        path = root / rel
        try:
            st = path.lstat()
        except (OSError, ValueError):
            missing.append(name)
            continue
        if not stat.S_ISREG(st.st_mode) or (
            sizes is not None and rel in sizes and st.st_size != sizes[rel]
        ):
            missing.append(name)
    return missing


def _marker_sizes(marker: Path) -> dict[str, int] | None:
    """The member sizes a done marker recorded (None for a marker without them)."""
    try:
        return json.loads(marker.read_text(encoding="utf-8")).get("sizes")
    except (OSError, ValueError):
        return None


def _write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
    source = tar.extractfile(member)
    try:
        with open(tmp, "xb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _same_content(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> bool:
    """Whether ``member`` holds exactly the bytes of the file at ``path`` (a copy written earlier
    in this run): read only for a member the tar holds twice."""
    if path.stat().st_size != member.size:
        return False
    source = tar.extractfile(member)
    with open(path, "rb") as written:
        while True:
            a, b = source.read(1 << 20), written.read(1 << 20)
            if a != b:
                return False
            if not a:
                return True


def _refuse(report: ShardReport, member: str, reason: str) -> None:
    report.refused_count += 1
    if len(report.refused) < MAX_LISTED:
        report.refused.append({"member": member, "reason": reason})


def extract_shard(shard_dir: Path, delete_tar: bool = False, force: bool = False) -> ShardReport:
    """Extract, verify and mark one shard; never raises (errors land in the report)."""
    shard_dir = Path(shard_dir)
    if not file_names.is_utf8(shard_dir):
        # build_manifest.py cannot hold its path as text and skips it: its audio would go unused.
        report = file_names.not_utf8(
            shard_dir, "path", "rename the directory in UTF-8 and rerun; its tar is untouched"
        )
        return ShardReport(report["path"], status="failed", error=report["reason"])
    report = ShardReport(str(shard_dir))
    tar_path, marker = shard_dir / TAR_FILE, shard_dir / DONE_MARKER
    try:
        members = read_index(shard_dir)
        if marker.is_file() and not force:
            # A done shard is checked before it is skipped: every index member must still be a
            # file of the size it was extracted with (one lstat each; no audio is read).
            missing = verify(shard_dir, members, _marker_sizes(marker))
            if not missing:
                report.status = "skipped_done"
                if delete_tar and tar_path.exists():
                    tar_path.unlink()
                    report.tar_deleted = True
                return report
            marker.unlink()  # the marker no longer tells the truth
            if not tar_path.exists():
                report.status, report.missing_count, report.missing = (
                    "unverified",
                    len(missing),
                    missing[:MAX_LISTED],
                )
                report.error = (
                    f"{len(missing)} member(s) of a finished shard are missing or changed size "
                    f"(first: {missing[0]}) and {tar_path} is gone: restore the tar and rerun"
                )
                return report
            report.reextracted_after_check = len(missing)
        marker.unlink(missing_ok=True)
        report.stale_temps_removed = remove_stale_temps(shard_dir)
        sizes: dict[str, int] | None = None
        if tar_path.exists():
            wanted = {normalized_name(m) for m in members}
            sizes = {}
            with tarfile.open(tar_path, "r:*") as tar:
                for member in tar:
                    if member.isdir():  # members are written with their own parents: nothing to do
                        continue
                    problem = member_problem(member)
                    if problem is None:
                        target, problem = target_path(shard_dir, member.name)
                    if problem is not None:
                        _refuse(report, member.name, problem)
                        continue
                    rel = normalized_name(member.name)
                    if rel not in wanted:
                        report.not_in_index += 1
                        continue
                    if rel in sizes:  # held twice: the later copy wins, as with tar -x
                        if _same_content(tar, member, target):
                            continue  # the same bytes again: nothing to write or report
                        report.conflicting_count += 1
                        if len(report.conflicting) < MAX_LISTED:
                            report.conflicting.append(
                                {"member": member.name, "sizes": [sizes[rel], member.size]}
                            )
                    try:
                        _write_member(tar, member, target)
                    except OSError as exc:
                        if disk_full(exc):
                            raise DiskFull(exc.errno, exc.strerror, str(target)) from None
                        # e.g. a directory already sits at the target
                        _refuse(report, member.name, f"cannot write: {exc.strerror or exc}")
                        continue
                    report.extracted += rel not in sizes
                    sizes[rel] = member.size
        missing = verify(shard_dir, members, sizes)
        report.missing_count, report.missing = len(missing), missing[:MAX_LISTED]
        if missing:
            report.status = "unverified"
            if not tar_path.exists():
                report.error = f"{tar_path} is gone and {len(missing)} member(s) are not extracted"
            return report
        root = shard_dir.resolve()
        write_json_atomically(
            {
                "members": len(members),
                "extracted": report.extracted,
                "refused": report.refused_count,
                "time": time.time(),
                # what a rerun checks before it skips this shard
                "sizes": {
                    rel: (root / rel).lstat().st_size
                    for rel in (normalized_name(m) for m in members)
                },
            },
            marker,
        )
        report.status = "extracted"
        if delete_tar and tar_path.exists():
            tar_path.unlink()
            report.tar_deleted = True
    except DiskFull as exc:
        report.status = "failed"
        report.error = (
            f"disk full writing {exc.filename} ({exc.strerror}): free space and rerun; the shards "
            f"already done keep their markers and are skipped"
        )
    except Exception as exc:  # a broken tar or index fails this shard only
        report.status = "failed"
        report.error = f"{type(exc).__name__}: {exc}"
    return report


def _pending_tar_bytes(shards: Sequence[Path], force: bool) -> list[int]:
    """Sizes of the tars of the shards this run will extract (no done marker, or ``force``)."""
    sizes = []
    for shard in shards:
        tar = shard / TAR_FILE
        if (force or not (shard / DONE_MARKER).is_file()) and tar.is_file():
            sizes.append(tar.stat().st_size)
    return sizes


def check_room(
    shards_dir: Path, shards: Sequence[Path], *, workers: int, delete_tars: bool, force: bool
) -> None:
    """ExtractError when SHARDS_DIR cannot take a file, or has less free space than the pending
    shards need: their tars' total size (a shard's audio is at most its tar), or with
    ``delete_tars`` the ``workers`` largest tars (each tar goes once its shard verifies)."""
    try:
        check_writable(shards_dir)
    except OSError as exc:
        raise ExtractError(
            f"cannot write into SHARDS_DIR {shards_dir}: {exc.strerror or exc}; fix the permissions"
        ) from None
    sizes = sorted(_pending_tar_bytes(shards, force), reverse=True)
    needed = sum(sizes[:workers]) if delete_tars else sum(sizes)
    free = shutil.disk_usage(shards_dir).free
    if needed > free:
        gib = 1 << 30
        hint = (
            ""
            if delete_tars
            else (f", or pass --delete-tars (needs about {sum(sizes[:workers]) / gib:.1f} GiB)")
        )
        raise ExtractError(
            f"{shards_dir} has {free / gib:.1f} GiB free; the {len(sizes)} shard(s) to extract "
            f"need about {needed / gib:.1f} GiB (their tars' size): free space{hint}; "
            f"--no-space-check skips this estimate"
        )


def extract_all(
    shards_dir: Path | None = None,
    *,
    workers: int | None = None,
    delete_tars: bool = False,
    force: bool = False,
    progress: bool = True,
    space_check: bool = True,
) -> dict:
    """Extract every shard under ``shards_dir`` (default SHARDS_DIR) on a process pool; return
    the summary, also written to ``<shards_dir>/extract_audio.summary.json``. When that write
    fails, the summary's ``summary_write_error`` says why (the rest of it is complete)."""
    shards_dir = Path(config.SHARDS_DIR if shards_dir is None else shards_dir)
    shards = find_shards(shards_dir)
    workers = workers or min(8, os.cpu_count() or 1)
    if space_check:
        check_room(shards_dir, shards, workers=workers, delete_tars=delete_tars, force=force)
    reports: list[ShardReport] = []
    with tqdm(total=len(shards), desc="extracting", unit="shard", disable=not progress) as bar:
        if workers == 1:
            for shard in shards:
                reports.append(extract_shard(shard, delete_tars, force))
                bar.update()
        else:
            # spawn, not fork: forking a process that already runs polars' thread pool can deadlock
            try:
                with ProcessPoolExecutor(
                    max_workers=workers, mp_context=multiprocessing.get_context("spawn")
                ) as pool:
                    for report in pool.map(
                        extract_shard,
                        shards,
                        [delete_tars] * len(shards),
                        [force] * len(shards),
                        chunksize=1,
                    ):
                        reports.append(report)
                        bar.update()
            except BrokenProcessPool:
                # extract_shard never raises: a worker that vanished was killed from outside
                raise ExtractError(
                    f"an extraction worker process died after {len(reports)} of {len(shards)} "
                    f"shard(s) (killed by the system: out of memory, or a signal): rerun, the "
                    f"finished shards keep their done markers and are skipped; --workers 1 needs "
                    f"the least memory"
                ) from None
    by_status: dict[str, int] = {}
    for r in reports:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    summary = {
        "shards": len(reports),
        "by_status": dict(sorted(by_status.items())),
        "files_extracted": sum(r.extracted for r in reports),
        "members_refused": sum(r.refused_count for r in reports),
        "members_not_in_index": sum(r.not_in_index for r in reports),
        "members_missing": sum(r.missing_count for r in reports),
        "stale_temps_removed": sum(r.stale_temps_removed for r in reports),
        "done_members_found_missing": sum(r.reextracted_after_check for r in reports),
        "members_conflicting": sum(r.conflicting_count for r in reports),
        "tars_deleted": sum(r.tar_deleted for r in reports),
        "problems": [
            asdict(r)
            for r in reports
            if r.status in ("failed", "unverified")
            or r.refused_count
            or r.reextracted_after_check
            or r.conflicting_count
        ],
    }
    path = shards_dir / SUMMARY_FILE
    try:
        write_json_atomically(summary, path)
    except OSError as exc:
        full = disk_full(exc)
        summary["summary_write_error"] = (
            f"cannot write {path}: {'disk full: ' if full else ''}{exc.strerror or exc}; the report "
            f"above is complete"
        )
    return summary


def format_summary(summary: dict) -> str:
    lines = [
        f"shards: {summary['shards']} ({', '.join(f'{k}={v}' for k, v in summary['by_status'].items())})",
        f"files extracted: {summary['files_extracted']:,}; refused: {summary['members_refused']:,}; "
        f"missing after extraction: {summary['members_missing']:,}; not in index (skipped): "
        f"{summary['members_not_in_index']:,}; tars deleted: {summary['tars_deleted']:,}",
        f"members of done shards found missing or resized on this run (extracted again where the "
        f"tar remains): {summary['done_members_found_missing']:,}",
    ]
    if summary["members_conflicting"]:
        lines.append(
            f"members held twice by a tar with different content (the later copy kept): "
            f"{summary['members_conflicting']:,}"
        )
    if summary["stale_temps_removed"]:
        lines.append(
            f"temp files of an interrupted run removed: {summary['stale_temps_removed']:,}"
        )
    for p in summary["problems"]:
        lines.append(
            f"{p['status'].upper()} {p['shard_dir']}" + (f": {p['error']}" if p["error"] else "")
        )
        for r in p["refused"]:
            lines.append(f"  refused {r['member']!r}: {r['reason']}")
        if p["refused_count"] > len(p["refused"]):
            lines.append(f"  ... {p['refused_count'] - len(p['refused'])} more refused")
        for m in p["missing"]:
            lines.append(f"  missing {m!r}")
        if p["missing_count"] > len(p["missing"]):
            lines.append(f"  ... {p['missing_count'] - len(p['missing'])} more missing")
        for c in p["conflicting"]:
            sizes = " and ".join(f"{n:,}" for n in c["sizes"])
            lines.append(f"  twice with different content {c['member']!r} ({sizes} bytes)")
        if p["conflicting_count"] > len(p["conflicting"]):
            lines.append(f"  ... {p['conflicting_count'] - len(p['conflicting'])} more held twice")
    if summary.get("summary_write_error"):
        lines.append(f"ERROR {summary['summary_write_error']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config.help_epilog(
            "extract_audio",
            "example:\n  SHARDS_DIR=/nvme/shards python scripts/extract_audio.py --workers 16 --delete-tars",
        ),
    )
    parser.add_argument(
        "--shards-dir",
        type=Path,
        default=None,
        help=f"shard tree (default SHARDS_DIR = {config.SHARDS_DIR})",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="processes (default: min(8, CPUs))"
    )
    parser.add_argument(
        "--delete-tars",
        action="store_true",
        help="delete each audio.tar once its shard is verified",
    )
    parser.add_argument(
        "--force", action="store_true", help="extract shards that already have a done marker"
    )
    parser.add_argument(
        "--no-space-check",
        action="store_true",
        help="start even when the free space looks smaller than the pending tars",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    try:
        summary = extract_all(
            args.shards_dir,
            workers=args.workers,
            delete_tars=args.delete_tars,
            force=args.force,
            progress=not args.no_progress,
            space_check=not args.no_space_check,
        )
    except ExtractError as exc:
        print(f"extract_audio: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    bad = summary["by_status"].get("failed", 0) + summary["by_status"].get("unverified", 0)
    return 1 if bad or summary.get("summary_write_error") else 0


if __name__ == "__main__":
    sys.exit(main())
