"""Shrink a `posattn compare` config read on stdin to a few seconds of training (the README test's
substitution for "edit my.yaml"): two models, one short length pair, a handful of steps."""
import sys

import yaml

config = yaml.safe_load(sys.stdin)
config.update(models=config["models"][:2], train_length=8, test_multipliers=[1, 2], vocab_size=16,
              examples={"train": 64, "valid": 16, "test": 16}, d_model=16)
config["task_params"] = {"num_kv_pairs": 2}
config["training"] = {**config["training"], "steps": 4, "batch_size": 8, "eval_every": 2}
yaml.safe_dump(config, sys.stdout, sort_keys=False)
