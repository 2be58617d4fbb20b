"""What a sweep runs: the spec file's grid and arms as trial specs, and the pairing of
each baseline-relative arm with its baseline. No Ray, no training."""
