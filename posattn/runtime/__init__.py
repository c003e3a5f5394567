"""What every experiment shares: files written atomically, safe names, (later) device, precision,
checkpoints, RNG state and the training loop."""
