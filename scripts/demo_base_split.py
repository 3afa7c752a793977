"""The demo's base model data: the rows of some languages of a train/val split, the split kept.

Usage (scripts/demo.sh runs it):
    python scripts/demo_base_split.py demo_data demo_data/base --languages en,hi

Reads ``<split dir>/train_manifest_v2.parquet`` and ``val_manifest_v2.parquet`` (make_train_val.py's
outputs) and writes the rows of ``--languages`` of each, columns and order unchanged, to the same
names under ``<out dir>``, both visible together (``atomic_files.write_together``). So the base model
trains on none of the finetune's validation rows, and is scored on the finetune's own validation
rows of its languages.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from atomic_files import write_together

NAMES = ("train_manifest_v2.parquet", "val_manifest_v2.parquet")


def split_languages(split_dir: Path, out_dir: Path, languages: list[str]) -> dict[str, int]:
    """Write the rows of ``languages`` of both manifests of ``split_dir`` to ``out_dir``; returns
    the rows written per manifest. ValueError when a manifest would hold none."""
    tables = {}
    for name in NAMES:
        if not (split_dir / name).is_file():
            raise ValueError(
                f"{split_dir / name} does not exist: run scripts/make_train_val.py on the manifest "
                f"first (its outputs are that directory's train and val manifests)"
            )
        table = pq.read_table(split_dir / name)
        kept = table.filter(pc.is_in(table["lang"], value_set=pa.array(languages)))
        if kept.num_rows == 0:
            raise ValueError(
                f"{split_dir / name} has no row of {','.join(languages)} (its languages: "
                f"{', '.join(sorted(set(table['lang'].to_pylist())))})"
            )
        tables[name] = kept
    out_dir.mkdir(parents=True, exist_ok=True)
    write_together(
        {
            out_dir / name: (lambda tmp, t=table: pq.write_table(t, tmp))
            for name, table in tables.items()
        },
        "base-split",
    )
    return {name: table.num_rows for name, table in tables.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("split_dir", type=Path, help="the directory of make_train_val's manifests")
    parser.add_argument("out_dir", type=Path, help="where the base model's manifests go")
    parser.add_argument("--languages", required=True, help="comma-separated, e.g. en,hi")
    args = parser.parse_args(argv)
    languages = [code.strip() for code in args.languages.split(",") if code.strip()]
    try:
        rows = split_languages(args.split_dir, args.out_dir, languages)
    except (OSError, ValueError) as exc:
        print(f"demo_base_split: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"base model data ({','.join(languages)}): "
        + ", ".join(f"{n} rows -> {args.out_dir / name}" for name, n in rows.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
