"""Export a train.py step checkpoint (.ckpt) as a .nemo file, written atomically.

Usage:
    python scripts/export_nemo.py data/checkpoints/step_00005000.ckpt        # -> step_00005000.nemo beside it
    python scripts/export_nemo.py data/checkpoints/step_00005000.ckpt --out parakeet-hi-en.nemo
    python scripts/export_nemo.py last                   # the newest step checkpoint in CHECKPOINT_DIR

The model is rebuilt the way train.py builds it (INIT_MODEL or MODEL_CONFIG, and TOKENIZER_DIR, set as
in training), the checkpoint's weights are loaded, and NeMo's ``save_to`` writes the file (the end of a
training run writes CHECKPOINT_DIR/step_<MAX_STEPS>.nemo by itself).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from process_control import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a step_*.ckpt written by train.py, or 'last'")
    parser.add_argument(
        "--out", type=Path, default=None, help="the .nemo path (default: the checkpoint's, .nemo)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    import asr_model
    import checkpoints

    path = checkpoints.resolve_model_path(args.checkpoint)
    if path.suffix != ".ckpt":
        raise ValueError(f"{path}: expected a .ckpt step checkpoint (a .nemo file needs no export)")
    out = args.out or path.with_suffix(".nemo")
    if out.suffix != ".nemo":
        raise ValueError(f"--out {out}: expected a path ending in .nemo")
    try:
        model = asr_model.load_trained_model(path, "cpu")
    except UserError as exc:
        print(f"export_nemo: error: {exc}", file=sys.stderr)
        return 2
    checkpoints.export_nemo(model, out)
    print(f"exported {path} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
