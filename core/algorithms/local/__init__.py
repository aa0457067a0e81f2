"""LocalRL: the embedded single-machine RL engine (inference server + policy-gradient trainer).

``LocalRL`` (the algorithm) and ``SFT`` import torch only when they start; ``engine``, ``server``,
``update``, ``loss``, ``sft`` and ``tiny`` are its parts.
"""

from voltrl.algorithms.local.algorithm import LocalRL
from voltrl.algorithms.local.sft import SFT

__all__ = ["SFT", "LocalRL"]
