"""Ray Tune over a plan: the driver, the trainable that runs in the workers, the
driver-side callbacks, the local Ray instance, experiment files, cluster launch,
the wheel nodes install, provenance and experiment trackers."""
