"""Pretraining configuration as data: one dataclass, its schema, size presets, every bad key reported at once.

A run config is a YAML mapping of :class:`PretrainConfig` fields. A *recipe* is the same mapping
plus ``runs:``, a list of per-run overrides (each with a ``label``), trained one after another
with the shared settings: a sweep as data.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from .. import schedule
from ..errors import PositionError
from ..experiments import config as config_loader
from ..experiments.config import ConfigError, Mechanism, Number, Schema, as_list
from ..mechanisms import Dims, registry, validate
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
    """Everything that determines a pretraining run (objective, model, data, optimisation); each field
    is described, bounded and checked in :class:`PretrainSchema`, which :func:`parse` validates against.
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
    pack_documents: bool = False

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
        """The fields as data; ``pack_documents`` only when on, so that the run folders written
        before the option existed still match their config on resume and rerun."""
        data = asdict(self)
        if not self.pack_documents:
            del data["pack_documents"]
        return data


def _default(key: str) -> Any:
    """The default of a :class:`PretrainConfig` field (the schema's defaults are the dataclass's)."""
    f = next(f for f in fields(PretrainConfig) if f.name == key)
    return f.default_factory() if f.default is MISSING else f.default


CHANG = "Chang et al. 2021, Table 4"
BERT = "BERT, Devlin et al. 2019, App. A.2"


class PretrainSchema(Schema):
    """A recipe is this mapping plus runs:, a list of per-run overrides, each with a label (a run's model:
    overrides merge into the recipe's); the runs train one after another with the shared settings and
    land in <out>/<label>."""

    name: str = Field(_default("name"), description="run name; default output folder runs/pretrain-<name>")
    objective: Literal[tuple(OBJECTIVES)] = Field(
        _default("objective"), description="mlm: a masked-LM encoder; clm: a causal-LM decoder")
    preset: Literal[tuple(PRESETS)] = Field(
        _default("preset"), description="model sizes: " + "; ".join(
            f"{k}: " + ", ".join(f"{a} {b}" for a, b in v.items()) for k, v in PRESETS.items())
        + " (small: Chang et al.'s BERT-small, Table 4, with embedding size = hidden size)")
    mechanisms: Annotated[list[Mechanism], BeforeValidator(as_list)] = Field(
        default_factory=lambda: _default("mechanisms"),
        description=f"position mechanisms, each a name or a mapping with its options; valid names: "
                    f"{', '.join(registry.names())}")
    model: dict[str, Any] = Field(default_factory=lambda: _default("model"),
                                  description=f"overrides of the preset's ModelConfig fields ({', '.join(MODEL_KEYS)});"
                                              f" max_len is the training sequence length")
    corpus: str = Field(_default("corpus"), description="a folder written by posattn corpus, or default (built from "
                                                        "the offline sources under runs/corpus/default on first use)")
    steps: int = Field(_default("steps"), ge=1, description="optimizer steps")
    batch_size: int = Field(_default("batch_size"), ge=1, description="sequences per optimizer step over all "
                                                                      "processes and micro-batches")
    grad_accum: int = Field(_default("grad_accum"), ge=1, description="micro-batches per optimizer step")
    lr: Number = Field(_default("lr"), gt=0, lt=1, description="peak learning rate of AdamW")
    warmup: Number = Field(_default("warmup"), ge=0, description=f"linear warmup, a fraction of steps below 1, else "
                                                                 f"a number of steps; then linear decay to 0 ({CHANG})")
    weight_decay: Number = Field(_default("weight_decay"), ge=0, lt=10, description=f"AdamW weight decay ({BERT})")
    betas: Annotated[list[Annotated[Number, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = Field(
        default_factory=lambda: _default("betas"), description=f"Adam betas ({BERT})")
    eps: Number = Field(_default("eps"), gt=0, description="Adam epsilon (BERT's reference code)")
    grad_clip: Number = Field(_default("grad_clip"), ge=0, description="gradient norm clipping (0: none)")
    mask_prob: Number = Field(_default("mask_prob"), gt=0, lt=1,
                              description=f"fraction of tokens masked for the MLM objective ({BERT}, as Chang et al. "
                                          f"2021)")
    dropout: Number = Field(_default("dropout"), ge=0, lt=1, description=f"dropout probability ({BERT})")
    eval_every: int = Field(_default("eval_every"), ge=1, description="steps between held-out evaluations")
    eval_sequences: int = Field(_default("eval_sequences"), ge=1, description="held-out sequences per evaluation")
    checkpoint_every: int = Field(_default("checkpoint_every"), ge=1, description="steps between resumable "
                                                                                  "checkpoints")
    log_every: int = Field(_default("log_every"), ge=1, description="steps between rows of metrics.jsonl")
    seed: int = Field(_default("seed"), ge=0, description="model initialisation, masking and batch order")
    precision: Literal[PRECISIONS] = Field(_default("precision"), description="auto: bf16 on a CUDA device that "
                                                                             "supports it, else fp32; fp16: CUDA only")
    data_workers: int | None = Field(_default("data_workers"), ge=0,
                                     description="processes that build batches ahead (null: 2 on CUDA, 0 on the "
                                                 "CPU, where batches cost ~1% of a step)")
    pack_documents: bool = Field(_default("pack_documents"),
                                 description="clm only: keep the documents of each training and held-out window "
                                             "apart, as if each ran alone (positions restart at each document, no "
                                             "attention or convolution crosses a boundary); a document ends with "
                                             "its [SEP] and the next starts at the token after it")

    @field_validator("model")
    @classmethod
    def _model_keys(cls, model: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(model) - set(MODEL_KEYS))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(map(str, unknown))}; valid keys: {', '.join(MODEL_KEYS)}")
        return model

    @model_validator(mode="after")
    def packing(self) -> PretrainSchema:
        if self.pack_documents and self.objective != "clm":
            raise ValueError(f"pack_documents: packs the causal-LM token stream (objective: clm); {self.objective} "
                             f"instances are sentence pairs of one document already")
        return self

    @model_validator(mode="after")
    def combined(self) -> PretrainSchema:
        """The model the sizes and mechanisms make must be one posattn can build."""
        try:
            mc = self.config().model_config(vocab_size=1000)
            validate(mc.mechanisms, Dims(mc.d_model, mc.n_heads, mc.n_layers, mc.max_len, mc.n_segments,
                                         self.objective == "clm"))
        except PositionError as e:
            raise ValueError(str(e)) from None
        return self

    def config(self) -> PretrainConfig:
        """The run config: the keys given, the others at their defaults."""
        return PretrainConfig(**{k: getattr(self, k) for k in type(self).model_fields if k in self.model_fields_set})


def schema_text() -> str:
    """The config's keys, types, defaults and meanings for ``posattn pretrain --help``, from the schema."""
    return config_loader.schema_text(PretrainSchema, "Config schema")


def parse(data: dict[str, Any], where: str = "config") -> PretrainConfig:
    """A validated :class:`PretrainConfig`; one :class:`ConfigError` lists every problem."""
    spec, problems = config_loader.check(PretrainSchema, data)
    config_loader.fail(f"pretraining config ({where})", problems)
    return spec.config()


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
        text, where, stem = config_loader.find_config(source, "posattn.pretrain", "recipe")
        raw = config_loader.parse_yaml(text, where, empty={})
        raw.setdefault("name", stem)
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
