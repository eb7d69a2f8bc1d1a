"""``python -m ds_muon.checkpoint``: see :mod:`ds_muon.checkpoint.cli`."""
import sys

from .cli import main

sys.exit(main())
