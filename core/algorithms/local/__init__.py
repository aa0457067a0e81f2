"""LocalRL and SFT: training a Hugging Face causal LM on this machine (a CPU or one GPU).

``LocalRL`` (the algorithm, :mod:`.algorithm`; its settings in groups, :mod:`.config`) and
``SFT`` (:mod:`.sft`) import torch only when they start. LocalRL's parts: :mod:`.schedule`
(which tasks each step runs, staleness), :mod:`.update` (the policy update; its settings in
:mod:`.update_config`, the maths in :mod:`.loss`), rows fed in micro-batches by
:mod:`.token_rows` (:mod:`.micro_batches`, :mod:`.shared_prefix`), :mod:`.master_weights`
(half-precision training), :mod:`.checkpoints` (weights on disk), :mod:`.memory` (will it fit)
and :mod:`.reports` (console lines). SFT's: :mod:`.conversations` (chat to token rows) and
:mod:`.supervised` (the supervised loop). What they train and serve with is below them:
:mod:`voltrl.models` (loading a model) and :mod:`voltrl.serving` (the engine behind an
OpenAI-compatible endpoint).
"""

from voltrl.algorithms.local.algorithm import LocalRL
from voltrl.algorithms.local.sft import SFT

__all__ = ["SFT", "LocalRL"]
