"""Algorithms: they publish resources, enqueue rollouts and learn from them."""
