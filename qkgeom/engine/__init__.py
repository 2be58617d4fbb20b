"""The training engine: corpus, model, hook points, metrics, the probe, the arms and
one training run. No database, no Ray."""
