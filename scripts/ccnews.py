"""CC-News helper for scripts/get-ccnews.sh.

    python scripts/ccnews.py download RAW_DIR [--start YYYY-MM-DD] [--end YYYY-MM-DD] [--processes N]
        news-please's Common Crawl crawler: downloads CC-NEWS WARC files and extracts the articles,
        appended as JSON lines to RAW_DIR/articles.<pid>.jsonl (needs internet and `pip install news-please`).
    python scripts/ccnews.py export RAW_DIR OUT_DIR [--per-file N]
        keeps English articles with text, drops repeated URLs, and writes OUT_DIR/ccnews.NNNN.jsonl.gz
        with {"id": url, "text": title + blank line + body} (the input of xlm_pkm.data.preprocess).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import os
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # xlm_pkm, run from anywhere

from xlm_pkm.utils.atomic import atomic_file  # noqa: E402

ARTICLE_FIELDS = ("url", "title", "maintext", "language", "date_publish")


def download(raw_dir: Path, start: str | None, end: str | None, processes: int) -> None:
    import logging

    from newsplease.crawler import commoncrawl_crawler

    raw_dir.mkdir(parents=True, exist_ok=True)

    def on_article(article) -> None:
        record = {k: getattr(article, k, None) for k in ARTICLE_FIELDS}
        record["date_publish"] = str(record["date_publish"]) if record["date_publish"] else None
        with open(raw_dir / f"articles.{os.getpid()}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")

    day = lambda s: datetime.strptime(s, "%Y-%m-%d") if s else None  # noqa: E731
    commoncrawl_crawler.crawl_from_commoncrawl(
        on_article, warc_files_start_date=day(start), warc_files_end_date=day(end),
        local_download_dir_warc=str(raw_dir / "warc"), number_of_extraction_processes=processes,
        delete_warc_after_extraction=True, continue_after_error=True, log_level=logging.WARNING)


def articles(raw_dir: Path):
    """English articles with a body, each URL once, from the raw JSONL files in name order."""
    seen: set[bytes] = set()
    for path in sorted(raw_dir.glob("*.jsonl")):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    a = json.loads(line)
                except ValueError:
                    continue
                body = (a.get("maintext") or "").strip()
                key = hashlib.sha1((a.get("url") or body).encode()).digest()[:8]
                if a.get("language") != "en" or not body or key in seen:
                    continue
                seen.add(key)
                title = (a.get("title") or "").strip()
                yield {"id": a.get("url"), "text": f"{title}\n\n{body}" if title else body}


def export(raw_dir: Path, out_dir: Path, per_file: int) -> None:
    """Write the articles in files of `per_file`, each written whole or not at all (xlm_pkm.utils.atomic)."""
    if not raw_dir.is_dir():
        raise SystemExit(f"error: raw directory not found: {raw_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    n, todo = 0, articles(raw_dir)
    for first in todo:
        with (atomic_file(out_dir / f"ccnews.{n // per_file:04d}.jsonl.gz") as raw,
              gzip.open(raw, "wt", encoding="utf-8") as f):
            for article in itertools.chain([first], itertools.islice(todo, per_file - 1)):
                f.write(json.dumps(article, ensure_ascii=False) + "\n")
                n += 1
    if n == 0:
        raise SystemExit(f"error: no English articles found in {raw_dir}/*.jsonl")
    print(f"exported {n} articles to {out_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download")
    d.add_argument("raw_dir", type=Path)
    d.add_argument("--start")
    d.add_argument("--end")
    d.add_argument("--processes", type=int, default=os.cpu_count())
    e = sub.add_parser("export")
    e.add_argument("raw_dir", type=Path)
    e.add_argument("out_dir", type=Path)
    e.add_argument("--per-file", type=int, default=200_000)
    args = parser.parse_args()
    if args.command == "download":
        download(args.raw_dir, args.start, args.end, args.processes)
    else:
        export(args.raw_dir, args.out_dir, args.per_file)


if __name__ == "__main__":
    main()
