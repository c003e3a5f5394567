"""Pretraining configuration as data: one dataclass, size presets, every bad key reported at once.

A run config is a YAML mapping of :class:`PretrainConfig` fields. A *recipe* is the same mapping
plus ``runs:``, a list of per-run overrides (each with a ``label``), trained one after another
with the shared settings: a sweep as data.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .. import schedule
from ..errors import PositionError
from ..experiments import config as config_loader
from ..experiments.config import ConfigError, is_int
from ..mechanisms import Dims, validate
from ..models.config import ModelConfig
from ..runtime.files import name_problem

OBJECTIVES = {"mlm": "encoder", "clm": "decoder"}
PRECISIONS = ("auto", "fp32", "bf16", "fp16")

# Size presets. `small` is Chang et al.'s BERT-small (Table 4) but with embedding size = hidden
# size (posattn has no factorised embedding); `tiny` trains in minutes on 2 CPU cores.
PRESETS: dict[str, dict[str, Any]] = {
    "mini": {"d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 256, "max_len": 64},
    "tiny": {"d_model": 128, "n_layers": 4, "n_heads": 4, "d_ff": 512, "max_len": 128},
    "small": {"d_model": 256, "n_layers": 12, "n_heads": 4, "d_ff": 1024, "max_len": 128},
    "base": {"d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 3072, "max_len": 128},
}
MODEL_KEYS = tuple(f.name for f in fields(ModelConfig) if f.name not in ("vocab_size", "mechanisms", "n_classes"))


@dataclass
class PretrainConfig:
    """Everything that determines a pretraining run (objective, model, data, optimisation).

    ``objective``: ``mlm`` trains an :class:`~posattn.Encoder` (masked LM), ``clm`` a
    :class:`~posattn.Decoder` (causal LM). ``preset`` gives the sizes; ``model`` overrides any
    :class:`~posattn.ModelConfig` field (``max_len`` is the training sequence length).
    ``batch_size`` counts sequences per optimizer step over all processes and micro-batches.
    ``warmup`` < 1 is a fraction of ``steps``; the learning rate then decays linearly to 0
    (Chang Table 4). ``corpus``: a folder written by ``posattn corpus``, or ``default`` (built
    from the offline sources under ``runs/corpus/default`` on first use). ``data_workers``:
    processes that build batches ahead (None: 2 on CUDA, 0 on the CPU, where batches cost ~1% of a step).
    """

    name: str = "default"
    objective: str = "mlm"
    preset: str = "tiny"
    mechanisms: list[Any] = field(default_factory=lambda: ["absolute"])
    model: dict[str, Any] = field(default_factory=dict)
    corpus: str = "default"
    steps: int = 300
    batch_size: int = 32
    grad_accum: int = 1
    lr: float = 1e-3
    warmup: float = 0.06
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-6
    grad_clip: float = 1.0
    mask_prob: float = 0.15
    dropout: float = 0.1
    eval_every: int = 100
    eval_sequences: int = 256
    checkpoint_every: int = 100
    log_every: int = 10
    seed: int = 0
    precision: str = "auto"
    data_workers: int | None = None

    @property
    def kind(self) -> str:
        return OBJECTIVES[self.objective]

    @property
    def warmup_steps(self) -> int:
        return schedule.warmup_steps(self.warmup, self.steps)

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step``: linear warmup, then linear decay to 0."""
        return schedule.lr_factor(step, self.steps, self.warmup_steps)

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The model's config: preset sizes, then overrides, the vocabulary and the mechanisms."""
        sizes = {**PRESETS[self.preset], "dropout": self.dropout, "init_std": 0.02, **self.model}
        return ModelConfig(vocab_size=vocab_size, mechanisms=list(self.mechanisms), **sizes)

    @property
    def length(self) -> int:
        """Training sequence length."""
        return int(self.model.get("max_len", PRESETS[self.preset]["max_len"]))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse(data: dict[str, Any], where: str = "config") -> PretrainConfig:
    """A validated :class:`PretrainConfig`; one :class:`ConfigError` lists every problem."""
    problems: list[str] = []
    valid = {f.name for f in fields(PretrainConfig)}
    problems += [f"unknown key {k!r}" for k in sorted(set(data) - valid)]
    known = {k: v for k, v in data.items() if k in valid}
    try:
        cfg = PretrainConfig(**known)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None
    if cfg.objective not in OBJECTIVES:
        problems.append(f"objective must be one of {', '.join(OBJECTIVES)}, got {cfg.objective!r}")
    if cfg.preset not in PRESETS:
        problems.append(f"preset must be one of {', '.join(PRESETS)}, got {cfg.preset!r}")
    if cfg.precision not in PRECISIONS:
        problems.append(f"precision must be one of {', '.join(PRECISIONS)}, got {cfg.precision!r}")
    if not isinstance(cfg.model, dict):
        problems.append("model must be a mapping of ModelConfig fields")
    else:
        problems += [f"model.{k}: unknown field (valid: {', '.join(MODEL_KEYS)})"
                     for k in sorted(set(cfg.model) - set(MODEL_KEYS))]
    for key in ("steps", "batch_size", "grad_accum", "eval_every", "eval_sequences", "checkpoint_every", "log_every"):
        value = getattr(cfg, key)
        if not is_int(value):
            problems.append(f"{key} must be a positive integer, got {value!r}")
    for key, lo, hi in (("lr", 0, 1), ("mask_prob", 0, 1), ("dropout", -1e-12, 1), ("weight_decay", -1e-12, 10)):
        value = getattr(cfg, key)
        if not isinstance(value, (int, float)) or not lo < value < hi or math.isnan(value):
            problems.append(f"{key} must be a number in ({lo}, {hi}), got {value!r}")
    if cfg.data_workers is not None and not (isinstance(cfg.data_workers, int) and cfg.data_workers >= 0):
        problems.append(f"data_workers must be null or an integer >= 0, got {cfg.data_workers!r}")
    if not (isinstance(cfg.warmup, (int, float)) and cfg.warmup >= 0):
        problems.append(f"warmup must be >= 0 (a fraction of steps below 1, else a step count), got {cfg.warmup!r}")
    if not (isinstance(cfg.betas, list) and len(cfg.betas) == 2 and all(0 <= b < 1 for b in cfg.betas)):
        problems.append(f"betas must be two numbers in [0, 1), got {cfg.betas!r}")
    if not problems:
        try:
            mc = cfg.model_config(vocab_size=1000)
            validate(mc.mechanisms, Dims(mc.d_model, mc.n_heads, mc.n_layers, mc.max_len, mc.n_segments,
                                         cfg.objective == "clm"))
        except PositionError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    return cfg


def builtin_configs() -> list[str]:
    """Names of the recipes shipped in ``posattn/pretrain/configs``."""
    return config_loader.builtin_configs("posattn.pretrain")


def load(source: str | Path | dict | None) -> tuple[str, list[tuple[str, PretrainConfig]]]:
    """(recipe name, [(label, config)]) from a YAML file, a built-in name, a dict or None (default).

    A plain config gives one run labelled by its name; a recipe (``runs:``) gives one per entry."""
    # Not experiments.config.load_config: None means no file (not a built-in default), an empty file is
    # the default config, and the messages name recipes and the file as given.
    if isinstance(source, dict):
        raw, where = dict(source), "config"
    elif source is None:
        raw, where = {}, "default"
    else:
        path, name = Path(str(source)), str(source).removesuffix(".yaml")
        if path.is_file():
            text, where = path.read_text(), str(path)
        elif name in builtin_configs():
            text, where = (resources.files("posattn.pretrain") / "configs" / f"{name}.yaml").read_text(), name
        else:
            raise ConfigError(f"config {source!r} is neither a file nor a built-in recipe; "
                              f"built-in recipes: {', '.join(builtin_configs())}")
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: the top level must be a mapping of config keys")
        raw.setdefault("name", path.stem if path.is_file() else name)
    runs = raw.pop("runs", None)
    unsafe = name_problem(raw.get("name", PretrainConfig.name), f"{where}: name")   # names the output folder
    if unsafe:
        raise ConfigError(unsafe)
    if runs is None:
        cfg = parse(raw, where)
        return cfg.name, [(cfg.name, cfg)]
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) and "label" in r for r in runs):
        raise ConfigError(f"{where}: runs must be a non-empty list of mappings, each with a label")
    labels = [r["label"] for r in runs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{where}: run labels must be unique, got {labels}")
    out, problems = [], [p for label in labels if (p := name_problem(label, f"{where}: run label"))]
    for r in runs:
        entry = {**raw, **{k: v for k, v in r.items() if k != "label"},
                 "name": f"{raw.get('name', 'recipe')}/{r['label']}"}
        if isinstance(raw.get("model"), dict) and isinstance(r.get("model"), dict):
            entry["model"] = {**raw["model"], **r["model"]}
        try:
            out.append((str(r["label"]), parse(entry, f"{where}, run {r['label']!r}")))
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))
    return str(raw.get("name", "recipe")), out


def with_overrides(cfg: PretrainConfig, **overrides: Any) -> PretrainConfig:
    """``cfg`` with command-line overrides (None values ignored), validated again."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return parse({**cfg.to_dict(), **given}) if given else replace(cfg)
