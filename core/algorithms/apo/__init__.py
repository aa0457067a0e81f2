"""APO: automatic prompt optimisation of an agent's ``PromptTemplate`` (:class:`APO`)."""

from voltrl.algorithms.apo.algorithm import APO, best_template
from voltrl.algorithms.apo.templates import CRITIQUE, INDUCE, REWRITE

__all__ = ["APO", "CRITIQUE", "INDUCE", "REWRITE", "best_template"]
