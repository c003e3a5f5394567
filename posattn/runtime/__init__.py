"""What every experiment shares: files written atomically with safe names (:mod:`.files`), folders
written whole (:mod:`.folders`), the device and precision (:mod:`.device`), the optimizer
(:mod:`.optim`), RNG state (:mod:`.rng`), deterministic batch order (:mod:`.order`), checkpoints
that load without unpickling code (:mod:`.checkpoint`) and one writer per run folder (:mod:`.lock`)."""
