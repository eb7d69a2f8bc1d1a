"""``python -m ds_muon.checkpoint to-universal CKPT_DIR OUT_DIR [--tag TAG]``: the checkpoint command line."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from ..errors import CheckpointError
from .safe_load import TRUST_ENV
from .universal import convert_to_universal

__all__ = ["main"]


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ds_muon.checkpoint to-universal CKPT_DIR OUT_DIR [--tag TAG]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m ds_muon.checkpoint", description="Convert a ds_muon ZeRO checkpoint to a universal checkpoint that loads at any data-parallel world size.")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("to-universal", help="convert a ds_muon ZeRO checkpoint to a universal checkpoint "
                                               "that loads at any data-parallel world size")
    conv.add_argument("ckpt_dir", help="the directory given to engine.save_checkpoint")
    conv.add_argument("out_dir", help="where to write the universal checkpoint (and its latest_universal file)")
    conv.add_argument("--tag", default=None, help="checkpoint tag (default: the one in CKPT_DIR/latest)")
    conv.add_argument("--trust-checkpoint", action="store_true",
                      help=f"load the files with torch.load(weights_only=False), as DeepSpeed does (only for files you "
                           f"trust: a crafted file runs code); the same as {TRUST_ENV}=1")
    args = parser.parse_args(argv)
    if args.trust_checkpoint:
        os.environ[TRUST_ENV] = "1"
    try:
        dst = convert_to_universal(args.ckpt_dir, args.out_dir, args.tag)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {dst}; load it at any data-parallel world size with \"checkpoint\": {{\"load_universal\": true}} "
          f"in the DeepSpeed config and engine.load_checkpoint({args.out_dir!r})")
    return 0
