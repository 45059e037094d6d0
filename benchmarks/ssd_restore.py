"""Restore of a ~4K-token prefix from SSD vs RAM vs cold prefill, and the read bandwidth the
SSD tier achieves vs the disk's own sequential read bandwidth, side by side in one run.

Not a test. Per family, on the ``bench`` fixture (block size 64 unless ``--block-size``):

1. cold: a fresh engine without cache prefills prefix + question (time to first token, TTFT);
2. RAM: an engine holding the prefix answers the same prefix + another question;
3. SSD (page cache warm): a new engine on the same cache directory (empty RAM) restores the
   prefix from the files the first engine wrote when it closed; the files are in the OS page
   cache, as right after a restart;
4. SSD (page cache dropped): the same after evicting the files from the page cache with
   ``posix_fadvise(DONTNEED)`` per file (it drops clean pages without privileges, and leaves
   the rest of a shared machine's cache alone) so the bytes really come from the disk.

The disk's sequential read bandwidth is measured on the same filesystem: a 1 GiB file written,
fsynced, dropped from the page cache, read back in 8 MiB reads.

    LD_PRELOAD=$(.venv/bin/python -m server.blas) HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/ssd_restore.py [--families qwen2_vl gemma3 qwen3_5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fixtures.build import ensure_fixture
from server.engine.model import LoadedModel, load_model
from server.engine.runner import ModelRunner
from server.engine.settings import EngineSettings
from server.engine.types import (
    ChatMessage,
    ImagePart,
    TextPart,
)
from tenancy.tenants import Tenant, make_tenant
from vision_cache.hashing import image_hash

from bench_inputs import picture, text_of, time_to_first_token  # noqa: E402  (sibling module of this script)

BLOCK = 64
@dataclass(frozen=True, slots=True)
class Sample:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    restore_s: float = 0.0
    read_bytes: int = 0
    read_s: float = 0.0
    read_io_s: float = 0.0


def request(runner: ModelRunner, tenant: Tenant, messages: list[ChatMessage]) -> Sample:
    before = runner.ssd.stats() if runner.ssd is not None else None
    reload_before = runner.tiered.stats.reload_seconds
    elapsed = time_to_first_token(runner, tenant, messages)
    trace = runner.last_trace
    if before is None or runner.ssd is None:
        return Sample(elapsed, trace.prompt_tokens, trace.cached_tokens)
    after = runner.ssd.stats()
    return Sample(
        elapsed,
        trace.prompt_tokens,
        trace.cached_tokens,
        restore_s=runner.tiered.stats.reload_seconds - reload_before,
        read_bytes=after.read_bytes - before.read_bytes,
        read_s=after.read_seconds - before.read_seconds,
        read_io_s=after.read_io_seconds - before.read_io_seconds,
    )


def drop_page_cache(directory: Path) -> str:
    """Evict ``directory``'s files from the page cache; says how.

    ``posix_fadvise(DONTNEED)`` drops a file's clean pages without privileges and without
    emptying the whole machine's cache (other processes share it); every file here is fsynced,
    so all its pages are clean.
    """
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(DONTNEED)"


def disk_read_bandwidth(directory: Path, size: int = 1 << 30) -> tuple[float, float, str]:
    """(cold MB/s, page-cache MB/s, how the cache was dropped) of one big sequential file."""
    path = directory / "seqread.bin"
    chunk = os.urandom(8 << 20)
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    how = drop_page_cache(directory)

    def read_all() -> float:
        buf = bytearray(8 << 20)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        return size / (time.perf_counter() - start) / 1e6

    cold = read_all()
    warm = read_all()
    path.unlink()
    return cold, warm, how


def bench_family(family: str, repeats: int, prefix_words: int, work: Path, block: int) -> dict:
    path = ensure_fixture(family, "bench")
    loaded: LoadedModel = load_model(path, block_size=block)
    tenant = make_tenant(b"bench-secret-0123456789abcdef012", "bench")
    img = picture()
    part = ImagePart(img, image_hash(tenant.salt, img))
    system = ChatMessage("system", (TextPart(text_of(prefix_words, 0)),))

    def messages(seed: int) -> list[ChatMessage]:
        return [system, ChatMessage("user", (part, TextPart(f"Question {seed}: " + text_of(30, seed))))]

    cache_dir = work / family
    shutil.rmtree(cache_dir, ignore_errors=True)

    def runner(ssd: bool) -> ModelRunner:
        settings = EngineSettings(
            model_path=path, cache_dir=cache_dir, block_size=block, prefill_chunk=max(512, block),
            ram_budget_bytes=4 << 30, ssd_enabled=ssd,
        )
        return ModelRunner(loaded, settings)

    results: dict[str, list[Sample]] = {"cold": [], "ram": [], "ssd_page_cache": [], "ssd_disk": []}
    request(runner(False), tenant, [ChatMessage("user", (TextPart("warm-up"),))])  # first-call costs
    results["cold"].append(request(runner(False), tenant, messages(1)))

    holder = runner(True)
    request(holder, tenant, messages(0))  # computes and stores the prefix
    for k in range(repeats):
        results["ram"].append(request(holder, tenant, messages(10 + k)))
    holder.close()  # writes every resident block

    drop_how = ""
    for k in range(repeats):
        for mode in ("ssd_page_cache", "ssd_disk"):
            if mode == "ssd_disk":
                drop_how = drop_page_cache(cache_dir)
            fresh = runner(True)
            results[mode].append(request(fresh, tenant, messages(100 + 2 * k + (mode == "ssd_disk"))))
            fresh.close()
    shutil.rmtree(cache_dir, ignore_errors=True)
    return {"family": family, "results": results, "drop": drop_how}


def median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["qwen2_vl"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=BLOCK, help="tokens per block (one file each)")
    parser.add_argument("--prefix-words", type=int, default=2450, help="system prompt words (~4K tokens with the image)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where cache files go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="vlmcache-ssd-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    disk_cold, disk_warm, disk_how = disk_read_bandwidth(work)
    print(f"disk sequential read ({work}): {disk_cold:,.0f} MB/s after {disk_how}, "
          f"{disk_warm:,.0f} MB/s from the page cache")
    report = {"disk_read_mb_s": disk_cold, "page_cache_read_mb_s": disk_warm, "disk_drop": disk_how, "families": []}
    for family in args.families:
        found = bench_family(family, args.repeats, args.prefix_words, work, args.block_size)
        results = found["results"]
        cold_ttft = median(results["cold"], "ttft_s")
        print(f"\n{family} (bench, block {args.block_size}): prompt {results['cold'][0].prompt_tokens} tokens, "
              f"medians of {args.repeats} (cold: 1 run); page cache dropped by {found['drop']}")
        print(f"{'mode':<16}{'cached':>8}{'TTFT s':>9}{'vs cold':>9}{'restore ms':>12}"
              f"{'read MB':>9}{'MB/s':>8}{'vs disk':>9}")
        for mode, samples in results.items():
            nbytes, restore = median(samples, "read_bytes"), median(samples, "restore_s")
            # Achieved bandwidth: bytes read over the whole promotion (read, checksum, decode,
            # insert into RAM), wall clock.
            rate = nbytes / restore / 1e6 if restore else 0.0
            print(f"{mode:<16}{int(median(samples, 'cached_tokens')):>8}{median(samples, 'ttft_s'):>9.3f}"
                  f"{cold_ttft / median(samples, 'ttft_s'):>8.1f}x{restore * 1e3:>12.1f}"
                  f"{nbytes / 1e6:>9.1f}{rate:>8,.0f}{rate / disk_cold:>8.2f}x")
        report["families"].append({
            "family": family, "drop": found["drop"],
            "results": {mode: [asdict(s) for s in samples] for mode, samples in results.items()},
        })
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
