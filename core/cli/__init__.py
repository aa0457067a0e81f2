"""The ``voltrl`` command line (:func:`main`); ``voltrl train`` builds its run from YAML with
:func:`build_from_config`."""

from voltrl.cli.main import main
from voltrl.cli.train import build_from_config

__all__ = ["build_from_config", "main"]
