"""``vlmcache cache stats|verify|gc|erase``: the command line of the offline cache tools.

Every command works on a cache directory whose server is stopped: it takes the SSD tier lock of
every model tree first and refuses (exit status 2) when a running server holds one. Long scans
draw a progress bar on stderr; results go to stdout (``--json`` for a machine-readable object).

- ``stats``: per model and tenant namespace, KV blocks and vision features with their bytes, as
  indexed and as found on disk (tenant ids shown when ``--keys`` is given).
- ``verify``: reads every file and checks its checksum, identity, place and index row; reports
  what is wrong (exit status 1 if anything is); ``--quarantine`` moves bad files to
  ``quarantine/`` and drops their rows and the rows of missing files.
- ``gc``: deletes temp files of unfinished writes and rows without files, then applies the
  keys file (``--keys``): each tenant's retention (expired records and quarantined files) and
  SSD quota; then ``--ssd-budget`` under the guaranteed-share rule.
- ``erase``: deletes a tenant's records (``--tenant``), or only what one of its sessions alone
  holds (``--tenant`` and ``--session``), from every model tree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from kv_cache.tiers import ssd_maintenance
from kv_cache.tiers.ssd_index import IndexRow, RecordKind
from kv_cache.tiers.ssd_reconcile import quarantine, quarantined_files
from kv_cache.tiers.ssd_writer import TEMP_SUFFIX
from server.bench.report import Progress
from server.config import parse_byte_size
from server.offline.cache_dir import ModelTree, OfflineError, keys_tenants, open_trees, tenant_namespace
from server.offline.verify import Finding, Verdict, record_files, verify_tree
from tenancy.keys import KeysFileError
from tenancy.sessions import InvalidSessionId, resolve_session_id


def add_cache_arguments(sub: argparse._SubParsersAction, default_cache_dir: Path) -> None:
    """Add the ``cache`` command and its subcommands to the top-level parser."""
    p = sub.add_parser("cache", help="inspect, verify, collect or erase a stopped server's cache "
                       "directory")
    csub = p.add_subparsers(dest="cache_cmd", required=True)

    def common(name: str, help_text: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        c = csub.add_parser(name, help=help_text)
        c.add_argument("--cache-dir", type=Path, default=default_cache_dir, metavar="DIR",
                       help=f"the server's --cache-dir (default {default_cache_dir})")
        c.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        c.set_defaults(func=func)
        return c

    stats = common("stats", "records and bytes per model and tenant namespace", cmd_stats)
    stats.add_argument("--keys", type=Path, metavar="FILE", help="keys file: show tenant ids")
    stats.add_argument("--tenant", metavar="ID", help="only this tenant")

    verify = common("verify", "check every file's checksum, identity and index row", cmd_verify)
    verify.add_argument("--quarantine", action="store_true",
                        help="move bad files to quarantine/ and drop their rows and the rows of "
                             "missing files")

    gc = common("gc", "apply retention, quotas and a budget; remove leftovers", cmd_gc)
    gc.add_argument("--keys", type=Path, metavar="FILE",
                    help="keys file: each tenant's retention_seconds and ssd_quota_bytes")
    gc.add_argument("--ssd-budget", metavar="SIZE", help="total file bytes to keep, e.g. 10GiB")

    erase = common("erase", "erase a tenant, or one session of a tenant", cmd_erase)
    erase.add_argument("--tenant", metavar="ID", required=True, help="tenant id")
    erase.add_argument("--session", metavar="ID", help="only what this session alone holds")
    erase.add_argument("--keys", type=Path, metavar="FILE",
                       help="keys file the tenant must be declared in (recommended: a typo then "
                            "fails instead of erasing nothing)")


def run(func: Callable[[argparse.Namespace, TextIO], dict[str, Any]], args: argparse.Namespace,
        text: Callable[[dict[str, Any]], str]) -> int:
    """Run a command body; print its result; map user errors to exit status 2."""
    try:
        result = func(args, sys.stderr)
    except (OfflineError, KeysFileError) as exc:
        print(f"vlmcache cache {args.cache_cmd}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else text(result))
    return int(result.get("exit_status", 0))


# -- stats ---------------------------------------------------------------------------------------


def cmd_stats(args: argparse.Namespace) -> int:
    return run(stats, args, _stats_text)


def stats(args: argparse.Namespace, progress_stream: TextIO) -> dict[str, Any]:
    """Per model tree and namespace: indexed and on-disk records and bytes."""
    names = keys_tenants(args.cache_dir, args.keys)
    only = tenant_namespace(args.cache_dir, args.tenant, args.keys) if args.tenant else None
    models: dict[str, Any] = {}
    with open_trees(args.cache_dir) as trees:
        for tree in trees:
            files = record_files(tree)
            progress = Progress(len(files), progress_stream)
            namespaces: dict[str, dict[str, Any]] = {}

            def entry(ns: str) -> dict[str, Any]:
                if ns not in namespaces:
                    tenant = names.get(ns)
                    namespaces[ns] = {
                        "tenant": tenant.tenant_id if tenant is not None else None,
                        **{f"{kind.value}_{what}": 0 for kind in RecordKind
                           for what in ("records", "bytes", "files_on_disk", "bytes_on_disk")},
                        "sessions": set(),
                    }
                return namespaces[ns]

            for row in tree.index.rows():
                if only is None or row.namespace == only:
                    e = entry(row.namespace)
                    e[f"{row.kind.value}_records"] += 1
                    e[f"{row.kind.value}_bytes"] += row.size
                    e["sessions"].update(row.owners)
            for kind, path in files:
                progress.advance(path.name)
                where = tree.layout.parse(kind, path)
                if where is not None and (only is None or where[0] == only):
                    e = entry(where[0])
                    e[f"{kind.value}_files_on_disk"] += 1
                    e[f"{kind.value}_bytes_on_disk"] += path.stat().st_size
            if files:
                progress.close()
            for e in namespaces.values():
                e["sessions"] = len(e["sessions"])
            models[tree.name] = dict(sorted(namespaces.items()))
        quarantined = quarantined_files(trees[0].layout) if trees else []
    counts: dict[str, int] = {}
    for found in quarantined:
        if only is None or found.namespace == only:
            counts[found.namespace] = counts.get(found.namespace, 0) + 1
    return {"cache_dir": str(args.cache_dir), "models": models, "quarantined": counts}


def _stats_text(result: dict[str, Any]) -> str:
    lines = [f"cache dir {result['cache_dir']}"]
    if not result["models"]:
        lines.append("no SSD tier here (nothing stored yet)")
    header = (f"  {'namespace':<16} {'tenant':<14} {'kv blocks':>9} {'kv bytes':>12} "
              f"{'features':>8} {'vision bytes':>12} {'sessions':>8}  on disk (kv/vision files)")
    for model, namespaces in result["models"].items():
        lines += [f"model {model}", header]
        for ns, e in namespaces.items():
            lines.append(
                f"  {ns:<16} {e['tenant'] or '-':<14} {e['kv_records']:>9} {e['kv_bytes']:>12} "
                f"{e['vision_records']:>8} {e['vision_bytes']:>12} {e['sessions']:>8}  "
                f"{e['kv_files_on_disk']}/{e['vision_files_on_disk']}"
            )
    for ns, count in sorted(result["quarantined"].items()):
        lines.append(f"quarantined files of {ns}: {count}")
    return "\n".join(lines)


# -- verify --------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    return run(verify, args, _verify_text)


def verify(args: argparse.Namespace, progress_stream: TextIO) -> dict[str, Any]:
    """Check every file; with ``--quarantine`` act on what is wrong."""
    models: dict[str, Any] = {}
    problems = 0
    with open_trees(args.cache_dir) as trees:
        for tree in trees:
            progress = Progress(len(record_files(tree)), progress_stream)
            report = verify_tree(tree, progress.advance)
            progress.close()
            actions = [_repair(tree, f) if args.quarantine else None for f in report.findings]
            problems += sum(1 for f in report.findings if f.verdict in (Verdict.CORRUPT, Verdict.MISSING))
            models[tree.name] = {
                "files": report.files,
                "ok": report.ok,
                "findings": [
                    {"verdict": f.verdict.value, "kind": f.kind.value, "path": str(f.path),
                     "namespace": f.namespace, "reason": f.reason, "action": action}
                    for f, action in zip(report.findings, actions)
                ],
            }
            if any(actions):
                tree.index.checkpoint()
    return {"cache_dir": str(args.cache_dir), "models": models, "problems": problems,
            "exit_status": 1 if problems else 0}


def _repair(tree: ModelTree, finding: Finding) -> str | None:
    """Act on one finding of ``verify --quarantine``; returns what was done."""
    if finding.key is None:
        return None
    if finding.verdict is Verdict.CORRUPT:
        tree.index.delete(finding.kind, finding.key)
        quarantine(tree.layout, finding.kind, finding.key, finding.path)
        return "quarantined"
    if finding.verdict is Verdict.MISSING:
        tree.index.delete(finding.kind, finding.key)
        return "row dropped"
    return None


def _verify_text(result: dict[str, Any]) -> str:
    lines = [f"cache dir {result['cache_dir']}"]
    for model, m in result["models"].items():
        lines.append(f"model {model}: {m['files']} files, {m['ok']} ok, {len(m['findings'])} findings")
        for f in m["findings"]:
            action = f" -> {f['action']}" if f["action"] else ""
            lines.append(f"  {f['verdict']:<9} {f['path']}: {f['reason']}{action}")
    lines.append("all files verified" if not result["problems"] else f"{result['problems']} problem(s)")
    return "\n".join(lines)


# -- gc ------------------------------------------------------------------------------------------


def cmd_gc(args: argparse.Namespace) -> int:
    return run(gc, args, _gc_text)


def gc(args: argparse.Namespace, progress_stream: TextIO, *, now: float | None = None) -> dict[str, Any]:
    """Leftovers, retention, quotas, budget (see the module docstring)."""
    budget = None
    if args.ssd_budget is not None:
        try:
            budget = parse_byte_size(args.ssd_budget)
        except ValueError as exc:
            raise OfflineError(f"--ssd-budget: {exc}") from None
    tenants = keys_tenants(args.cache_dir, args.keys)
    now = time.time() if now is None else now
    cutoffs = {ns: now - t.settings.retention_seconds for ns, t in tenants.items()
               if t.settings.retention_seconds is not None}
    quotas = {ns: t.settings.ssd_quota_bytes for ns, t in tenants.items()
              if t.settings.ssd_quota_bytes is not None}
    models: dict[str, Any] = {}
    quarantine_expired = 0
    with open_trees(args.cache_dir) as trees:
        for tree in trees:
            files = record_files(tree)
            progress = Progress(len(files) + 1, progress_stream)
            temp = 0
            for kind, path in files:
                progress.advance(path.name)
                if tree.layout.parse(kind, path) is None and path.name.endswith(TEMP_SUFFIX):
                    path.unlink(missing_ok=True)
                    temp += 1
            on_disk = {(kind, path) for kind, path in files}
            orphans = [row for row in tree.index.rows()
                       if (row.kind, tree.layout.path(row.kind, row.namespace, row.key)) not in on_disk]
            for row in orphans:
                tree.index.delete(row.kind, row.key)
            expired = ssd_maintenance.expire(tree.index, tree.layout, cutoffs)
            usage = {ns: size for ns, (_, size) in tree.index.namespace_totals().items()}
            over_quota = ssd_maintenance.enforce_quotas(tree.index, tree.layout, quotas, usage)
            over_budget: list[IndexRow] = []
            if budget is not None:
                over_budget = ssd_maintenance.enforce_capacity(tree.index, tree.layout, budget, quotas, usage)
            ssd_maintenance.prune_namespace_dirs(tree.layout, [*expired, *over_quota, *over_budget])
            tree.index.checkpoint()
            progress.advance("done")
            progress.close()
            models[tree.name] = {
                "temp_files_removed": temp,
                "rows_without_file_dropped": len(orphans),
                "expired": _tallies(expired),
                "over_quota": _tallies(over_quota),
                "over_budget": _tallies(over_budget),
            }
        if trees:
            retention = {ns: t.settings.retention_seconds for ns, t in tenants.items()
                         if t.settings.retention_seconds is not None}
            quarantine_expired = ssd_maintenance.expire_quarantine(trees[0].layout, retention, now)
    return {"cache_dir": str(args.cache_dir), "models": models,
            "quarantined_files_expired": quarantine_expired}


def _tallies(rows: list[IndexRow]) -> dict[str, dict[str, int]]:
    return {kind.value: tally.as_dict() for kind, tally in ssd_maintenance.tallies(rows).items()}


def _gc_text(result: dict[str, Any]) -> str:
    lines = [f"cache dir {result['cache_dir']}"]
    for model, m in result["models"].items():
        parts = [f"{m['temp_files_removed']} temp files", f"{m['rows_without_file_dropped']} rows without file"]
        for what in ("expired", "over_quota", "over_budget"):
            t = m[what]
            parts.append(f"{what.replace('_', ' ')}: {t['kv']['count']} blocks ({t['kv']['bytes']} B), "
                         f"{t['vision']['count']} features ({t['vision']['bytes']} B)")
        lines.append(f"model {model}: " + "; ".join(parts))
    lines.append(f"quarantined files expired: {result['quarantined_files_expired']}")
    return "\n".join(lines)


# -- erase ---------------------------------------------------------------------------------------


def cmd_erase(args: argparse.Namespace) -> int:
    return run(erase, args, _erase_text)


def erase(args: argparse.Namespace, progress_stream: TextIO) -> dict[str, Any]:
    """Erase a tenant, or what one of its sessions alone holds, from every model tree."""
    namespace = tenant_namespace(args.cache_dir, args.tenant, args.keys)
    session = None
    if args.session is not None:
        try:
            session = resolve_session_id(args.session, None, None)
        except InvalidSessionId as exc:
            raise OfflineError(f"--session: {exc}") from None
    models: dict[str, Any] = {}
    with open_trees(args.cache_dir) as trees:
        for tree in trees:
            if session is None:
                deleted, kept = ssd_maintenance.erase_namespace(tree.index, tree.layout, namespace), 0
            else:
                deleted, kept = ssd_maintenance.erase_owner(tree.index, tree.layout, namespace, session)
            tree.index.compact()
            models[tree.name] = {"deleted": _tallies(deleted), "kept_shared": kept}
    return {"cache_dir": str(args.cache_dir), "tenant": args.tenant, "namespace": namespace,
            "session": session, "models": models}


def _erase_text(result: dict[str, Any]) -> str:
    who = f"tenant {result['tenant']} ({result['namespace']})"
    if result["session"] is not None:
        who += f", session {result['session']}"
    lines = [f"erased {who} in {result['cache_dir']}"]
    for model, m in result["models"].items():
        d = m["deleted"]
        lines.append(f"model {model}: {d['kv']['count']} blocks ({d['kv']['bytes']} B), "
                     f"{d['vision']['count']} features ({d['vision']['bytes']} B) deleted; "
                     f"{m['kept_shared']} shared records kept")
    return "\n".join(lines)

