"""What a run shows: metrics and trackers, plots, failure reports, ``voltrl show`` and the
dashboard."""
