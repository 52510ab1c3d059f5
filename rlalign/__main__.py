"""``python -m rlalign`` (and ``torchrun --nproc-per-node N -m rlalign grpo ...``): the CLI."""

import sys

from rlalign.cli import main

sys.exit(main())
