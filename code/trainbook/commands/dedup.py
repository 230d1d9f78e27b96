"""trainbook dedup: remove exact and near-duplicate documents from text files.

Each file is one document, or, with --split paragraph, each blank-line-separated block of each
file. Exact duplicates share the hash of their normalised text; near duplicates share a MinHash
LSH bucket: --bands b of --rows r MinHashes of word --ngram shingles (default 14 x 8 of
5-grams, FineWeb's), so a pair of Jaccard similarity s becomes a candidate with probability
1 - (1 - s^r)^b. --threshold S also requires a candidate pair's signatures to agree on a
fraction >= S. Clusters are transitive; each keeps its first document. --out writes the kept
documents, separated by blank lines.

Chapter: book/pretraining/data-tokenization.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..pretrain import dedup
from ._args import check_writable, finite_float, non_negative_int, positive_int

HELP = "exact and MinHash-LSH near-duplicate removal over text files"
MAX_HASHES = 100_000  # bands * rows; published pipelines use 112 (FineWeb) to 9,000 (Lee et al.)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files")
    p.add_argument("--split", choices=("file", "paragraph"), default="file",
                   help="a document is a file (default) or a blank-line-separated paragraph")
    p.add_argument("--bands", type=positive_int, default=14, help="LSH bands (default 14)")
    p.add_argument("--rows", type=positive_int, default=8,
                   help="MinHashes per band (default 8); bands * rows hashes in all")
    p.add_argument("--ngram", type=positive_int, default=5, help="words per shingle (default 5)")
    p.add_argument("--threshold", type=finite_float, default=None,
                   help="also require candidates' signatures to agree on at least this "
                        "fraction (estimated Jaccard); default: LSH buckets alone")
    p.add_argument("--exact-only", action="store_true", help="skip near-duplicate detection")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the MinHash functions (default 0)")
    p.add_argument("--out", default=None, help="write the kept documents to this file")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _documents(files: list[str], split: str) -> tuple[list[str], list[str]]:
    docs, names = [], []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ValueError(f"no file at {f}; give UTF-8 text files")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{f} is not UTF-8 text") from None
        if split == "file":
            if not text.strip():
                continue  # an empty file is no document
            docs.append(text)
            names.append(f)
        else:
            for i, block in enumerate(b for b in text.split("\n\n") if b.strip()):
                docs.append(block.strip("\n"))
                names.append(f"{f}#{i}")
    if not docs:
        raise ValueError("no documents: the files are empty; give files with text")
    return docs, names


def run(args: argparse.Namespace) -> int:
    if args.threshold is not None and not 0 <= args.threshold <= 1:
        raise ValueError(f"--threshold must be in [0, 1], got {args.threshold}")
    if args.bands * args.rows > MAX_HASHES:
        raise ValueError(f"--bands {args.bands} x --rows {args.rows} = "
                         f"{args.bands * args.rows:,} MinHashes per document; use at most "
                         f"{MAX_HASHES:,} (FineWeb uses 14 x 8 = 112)")
    check_writable(args.out, "--out")
    docs, names = _documents(args.files, args.split)
    res = dedup.deduplicate(docs, args.bands, args.rows, args.ngram, args.threshold, args.seed,
                            near=not args.exact_only)
    counts = res.removed(len(docs))
    out = {**counts, "bands": args.bands, "rows": args.rows, "ngram": args.ngram,
           "threshold": args.threshold,
           "s_at_half": dedup.threshold(args.bands, args.rows),
           "exact_groups": [[names[i] for i in g] for g in res.exact],
           "near_clusters": [[names[i] for i in g] for g in res.near]}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n\n".join(docs[i] for i in res.keep) + "\n", encoding="utf-8")
        out["out"] = args.out
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{counts['documents']} documents: {counts['exact']} exact duplicates, "
          f"{counts['near']} near duplicates removed, {counts['kept']} kept")
    if not args.exact_only:
        print(f"LSH {args.bands} bands x {args.rows} rows of {args.ngram}-gram MinHashes: "
              f"P(candidate) = 1/2 at Jaccard {out['s_at_half']:.2f}")
    for c in out["near_clusters"][:20]:
        print("near: " + ", ".join(c))
    if args.out:
        print(f"wrote {len(res.keep)} documents to {args.out}")
    return 0
