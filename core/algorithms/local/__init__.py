"""LocalRL: the embedded single-machine RL engine (inference server + policy-gradient trainer).

``LocalRL`` (the algorithm) imports torch only when it starts; ``engine``, ``server``,
``update``, ``loss``, ``sft`` and ``tiny`` are its parts.
"""

from voltrl.algorithms.local.algorithm import LocalRL

__all__ = ["LocalRL"]
