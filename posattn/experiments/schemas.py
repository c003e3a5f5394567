"""The schema of every kind of config, by the command that reads it: what the documentation's
tables are generated from (:func:`posattn.experiments.config.schema_markdown` of each)."""
from __future__ import annotations

from pydantic import BaseModel

from posattn.finetune.schema import FinetuneSuiteConfig
from posattn.pretrain.config import PretrainSchema
from posattn.synthetic.schema import CompareConfig

CONFIG_SCHEMAS: dict[str, type[BaseModel]] = {
    "compare": CompareConfig,          # posattn compare CONFIG: a sweep of synthetic-task cells
    "finetune": FinetuneSuiteConfig,   # posattn finetune CONFIG: checkpoints × tasks × seeds
    "pretrain": PretrainSchema,        # posattn pretrain CONFIG: one run, or a recipe with runs:
}
