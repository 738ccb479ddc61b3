import os

import torch

# Deterministic, quiet, and sized for a 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
