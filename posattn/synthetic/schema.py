"""The schema of a ``posattn compare`` config: every key, its type, default and meaning, and every check.

:class:`CompareConfig` is the one declaration the config is validated against (all problems at
once, see :func:`posattn.experiments.config.check`) and that ``posattn compare --help`` and the
documentation print. A check that combines several keys runs once those keys are valid on their own:
one that reads earlier keys in a field validator, the rest (task data at every length, one model
per entry and width) in :meth:`CompareConfig.combined`. :mod:`posattn.synthetic.compare` expands a
valid config into cells.
"""
from __future__ import annotations

from itertools import product
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from posattn.claims import parse_claims
from posattn.experiments.config import Mechanism, Name, Number, Schema, Shown, inherited, is_int, report, several
from posattn.experiments.fields import ExecutorBlock, executor_field
from posattn.mechanisms import registry
from posattn.models import build_model
from posattn.synthetic.generators import TASK_PARAMS, TASKS, TaskError, generate
from posattn.synthetic.train import TrainConfig

MODEL_KEYS = ("n_heads", "d_ff", "max_len", "dropout", "attn_path", "init_std")   # a model entry may override them
DEFAULT_MULTIPLIERS = [1, 2, 4, 8]


def _empty_if_none(value: Any) -> Any:
    return {} if value is None else value


def task_params_at(task_params: dict[str, Any], train_length: int) -> dict[str, Any]:
    """A task's options at one training length: ``kv_density`` turned into ``num_kv_pairs``."""
    params = dict(task_params)
    density = params.pop("kv_density", None)
    if density is not None:
        params["num_kv_pairs"] = max(1, round(density * train_length))
    return params


def task_lines() -> str:
    return "; ".join(f"{task}: {', '.join(f'{k}={v}' for k, v in params.items())}"
                     for task, params in TASK_PARAMS.items())


class Examples(Schema):
    """How many examples each split holds."""

    train: int = Field(20000, ge=1, description="training examples (one fixed set, cycled through)")
    valid: int = Field(500, ge=1, description="validation examples at the training length: early stopping "
                                              "(training.target_accuracy) and the choice of lr")
    test: int = Field(500, ge=1, description="test examples per test length (those also in the training set "
                                             "are dropped)")


class ModelEntry(Schema):
    """One row (per depth) of the report: a model's mechanisms, depth(s) and settings."""

    mechanisms: Annotated[several(Mechanism, "spec"), Shown("[name | {name: ..., option: value}]")] = Field(
        description=f"position mechanisms of the decoder, each a name or a mapping with its options; "
                    f"valid names: {', '.join(registry.names())}")
    layers: several(Annotated[int, Field(ge=1)], "int") = Field(
        default_factory=lambda: [2], description="depth(s); each depth is its own row and its own cells")
    label: str | None = Field(None, description="row name in the report (default: the mechanism names and "
                                                    "the depth, e.g. 'cat (1L)'); with several depths the depth "
                                                    "is appended")
    # A setting given here overrides the top level's for this entry (null max_len or init_std included).
    n_heads: int = Field(None, ge=1, json_schema_extra=inherited("n_heads"), description="attention heads")
    d_ff: int = Field(None, ge=0, json_schema_extra=inherited("d_ff"), description="MLP width")
    max_len: int | None = Field(None, ge=2, json_schema_extra=inherited("max_len"),
                                description="positions the model is built for")
    dropout: Number = Field(None, ge=0, lt=1, json_schema_extra=inherited("dropout"),
                            description="dropout probability")
    attn_path: Literal["fast", "reference"] = Field(None, json_schema_extra=inherited("attn_path"),
                                                    description="attention implementation")
    init_std: Number | None = Field(None, gt=0, json_schema_extra=inherited("init_std"),
                                    description="init of linear maps")


class Training(Schema):
    """Optimisation settings shared by every cell (:class:`posattn.synthetic.train.TrainConfig`, its
    ``seed`` aside: that comes from ``seeds``)."""

    steps: int = Field(TrainConfig.steps, ge=1, description="optimizer steps (fewer when training stops early)")
    batch_size: int = Field(TrainConfig.batch_size, ge=1, description="sequences per optimizer step")
    lr: several(Annotated[Number, Field(gt=0)], "number") = Field(
        default_factory=lambda: [TrainConfig.lr],
        description="peak learning rate of AdamW; a list makes one cell per value, and the report keeps, per "
                    "model and setting, the one with the best validation accuracy")
    weight_decay: Number = Field(TrainConfig.weight_decay, ge=0, description="AdamW weight decay (not applied to "
                                                                             "biases, norms and embeddings)")
    warmup: Number = Field(TrainConfig.warmup, ge=0, description="linear warmup: a fraction of steps below 1, "
                                                                 "else a number of steps; then cosine decay")
    min_lr_ratio: Number = Field(TrainConfig.min_lr_ratio, ge=0, le=1,
                                 description="the cosine decay ends at lr · min_lr_ratio")
    grad_clip: Number = Field(TrainConfig.grad_clip, ge=0, description="gradient norm clipping (0: none)")
    target_accuracy: Number | None = Field(TrainConfig.target_accuracy, gt=0, le=1,
                                              description="stop early once validation accuracy reaches it "
                                                          "(null: train every step)")
    eval_every: int = Field(TrainConfig.eval_every, ge=1, description="steps between validation evaluations")
    eval_batch_size: int = Field(TrainConfig.eval_batch_size, ge=1,
                                 description="largest evaluation batch (smaller at long test lengths, to bound "
                                             "the attention matrices' memory)")


class CompareConfig(Schema):
    """Every combination of model entry, depth, width (d_model), training length, learning rate and seed
    is one cell: one model trained and evaluated at every test length.

    Tasks (vocabulary V; token 0 is filler or noise): mqar and mqnar hold D key-value pairs (keys from
    [1, V/2), values from [V/2, V); mqnar keys are N-grams), then query every key once at power-law gaps
    (Zoology's layout, Arora et al. 2023); ar and nar hold the same context, then one query at the very end;
    selective_copy hides num_tokens content tokens among noise, then a separator (token 1), then the
    content tokens in order. Accuracy is the fraction of scored tokens (query answers, copied tokens)
    predicted exactly. A model that cannot run a test length (e.g. `absolute` beyond max_len) gets null
    there, with the reason in the report."""

    name: Name = Field("default", description="sweep name; default output folder runs/compare-<name>")
    task: Literal[TASKS] = Field("mqar", description="the synthetic task (see Tasks below)")
    task_params: Annotated[dict[str, Any], BeforeValidator(_empty_if_none)] = Field(
        default_factory=dict,
        description=f"options of the task, with their defaults: {task_lines()}; the recall tasks also take "
                    f"kv_density: num_kv_pairs = round(kv_density · training length)")
    vocab_size: int = Field(64, ge=3, description="vocabulary size V")
    train_length: several(Annotated[int, Field(ge=2)], "int") = Field(
        default_factory=lambda: [64], description="training sequence length(s); each is its own set of cells")
    test_lengths: several(Annotated[int, Field(ge=2)], "int") | None = Field(
        None, description="absolute test lengths (instead of test_multipliers)")
    test_multipliers: several(Annotated[Number, Field(gt=0)], "number") | None = Field(
        None, description=f"test lengths as multiples of the training length (default {DEFAULT_MULTIPLIERS} "
                          f"unless test_lengths is given)")
    examples: Annotated[Examples, BeforeValidator(_empty_if_none)] = Field(
        default_factory=Examples, description="examples per split")
    data_seed: int = Field(0, ge=0, description="seeds the data (train, valid and test come from disjoint streams)")
    seeds: several(Annotated[int, Field(ge=0)], "int") = Field(
        default_factory=lambda: [0], description="model initialisation and batch order; one set of cells each")
    d_model: several(Annotated[int, Field(ge=1)], "int") = Field(
        default_factory=lambda: [64], description="model width(s) to sweep")
    n_heads: int = Field(2, ge=1, description="attention heads")
    d_ff: int = Field(0, ge=0, description="MLP width (0: blocks without MLP, as Zoology's synthetic-task models)")
    max_len: int | None = Field(None, ge=2, description="positions a model is built for (null: the longest "
                                                           "test length)")
    dropout: Number = Field(0.0, ge=0, lt=1, description="dropout probability")
    attn_path: Literal["fast", "reference"] = Field("fast", description="attention implementation (reference: "
                                                                        "the slow, plain one)")
    init_std: Number | None = Field(None, gt=0, description="null: PyTorch's default init of linear maps; "
                                                               "0.02: GPT-2's, as Zoology")
    models: Annotated[list[ModelEntry], Field(min_length=1)] = Field(
        description="the models to compare, e.g. [{mechanisms: [cat], layers: 1}, {mechanisms: [rope], layers: 2}]")
    training: Annotated[Training, BeforeValidator(_empty_if_none)] = Field(
        default_factory=Training, description="optimisation settings of every cell")
    claims: list[Any] | None = Field(
        None, description="papers' claims, judged on test accuracy at the best lr (posattn.claims): "
                          "[{claim: str, paper: str, holds: ['cat (1L) > rope (2L)', 'absolute (2L) >= 0.99'], "
                          "at: {d_model: int, train_length: int, length: int | train | longest}}]; at is optional "
                          "and a key left out of it means every value (length: the training length)")
    executor: ExecutorBlock = executor_field()

    @field_validator("task_params")
    @classmethod
    def _task_params(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        task = info.data.get("task")
        if task is None:                                    # the task itself is wrong
            return params
        valid = [*TASK_PARAMS[task], *(["kv_density"] if task != "selective_copy" else [])]
        if set(params) - set(valid):
            raise ValueError(f"the options of {task} are {', '.join(valid)}; got {params!r}")
        if "kv_density" in params and "num_kv_pairs" in params:
            raise ValueError("give num_kv_pairs or kv_density, not both")
        return params

    @field_validator("test_multipliers")
    @classmethod
    def _not_both(cls, multipliers: list | None, info: ValidationInfo) -> list | None:
        if multipliers is not None and info.data.get("test_lengths") is not None:
            raise ValueError("give test_lengths or test_multipliers, not both")
        return multipliers

    @field_validator("claims")
    @classmethod
    def _claims(cls, claims: list | None, info: ValidationInfo) -> list | None:
        problems: list[str] = []
        parsed = parse_claims(claims, problems, optional=("at",))
        lengths, widths = info.data.get("train_length"), info.data.get("d_model")
        if lengths is not None and widths is not None:
            for i, claim in enumerate(parsed):
                problems += [f"claims[{i}].at: {p}" for p in at_problems(claim.at, lengths, widths)]
        report(problems)
        return claims

    @model_validator(mode="after")
    def combined(self) -> CompareConfig:
        """The checks that need every key: task data at every length, each entry's max_len against the
        training length, distinct row labels, and each model built once per width, so that a bad option
        fails now rather than mid-sweep."""
        problems = []
        for n, lengths in self.lengths().items():
            for length in lengths:
                try:
                    generate(self.task, 1, length, self.vocab_size, self.data_seed, "test",
                             **task_params_at(self.task_params, n))
                except TaskError as e:
                    problems.append(f"task {self.task} at length {length} (training length {n}): {e}")
        specs = self.row_specs()
        longest = max(self.train_length)
        problems += [f"{s['where']}: max_len {s['max_len']} is shorter than the training length {longest}"
                     for s in specs if s["max_len"] < longest]
        labels = [s["label"] for s in specs]
        dupes = sorted({lab for lab in labels if labels.count(lab) > 1})
        if dupes:
            problems.append(f"models: duplicate row label(s) {', '.join(dupes)}; give the entries distinct labels")
        for s, d in product(specs, self.d_model):
            if s["max_len"] < longest:
                continue
            try:
                build_model(self.decoder_config(s, d))
            except (ValueError, TypeError, KeyError) as e:
                problems.append(f"{s['where']} ({s['label']}, d_model={d}): {e}")
        report(problems)
        return self

    def lengths(self) -> dict[int, list[int]]:
        """Per training length, the sorted test lengths."""
        if self.test_lengths is not None:
            return {n: sorted(set(self.test_lengths)) for n in self.train_length}
        multipliers = self.test_multipliers or DEFAULT_MULTIPLIERS
        return {n: sorted({max(2, round(m * n)) for m in multipliers}) for n in self.train_length}

    def row_specs(self) -> list[dict[str, Any]]:
        """One spec per (model entry, depth): where it is, label, mechanisms, layers and the model settings
        (an entry's own, else the top level's; max_len null: the longest test length)."""
        longest = max(max(v) for v in self.lengths().values())
        specs = []
        for i, entry in enumerate(self.models):
            settings = {k: getattr(entry if k in entry.model_fields_set else self, k) for k in MODEL_KEYS}
            settings["max_len"] = settings["max_len"] or longest
            for depth in entry.layers:
                specs.append({"where": f"models[{i}]", "label": _label(entry, depth), "mechanisms": entry.mechanisms,
                              "layers": depth, **settings})
        return specs

    def decoder_config(self, spec: dict[str, Any], d_model: int) -> dict[str, Any]:
        """The ``build_model`` dict of one spec at one width."""
        return {"kind": "decoder", "vocab_size": self.vocab_size, "d_model": d_model, "n_layers": spec["layers"],
                "mechanisms": spec["mechanisms"], **{k: spec[k] for k in MODEL_KEYS}}


def _label(entry: ModelEntry, depth: int) -> str:
    if entry.label is None:
        names = "+".join(m if isinstance(m, str) else str(m.get("name")) for m in entry.mechanisms)
        return f"{names} ({depth}L)"
    return f"{entry.label} ({depth}L)" if len(entry.layers) > 1 else entry.label


def at_problems(at: dict[str, Any], train_lengths: list[int], widths: list[int]) -> list[str]:
    """Problems of a claim's ``at``: d_model / train_length among the sweep's, length an integer,
    ``train`` (the training length, the default) or ``longest``."""
    bad = [f"unknown key {k!r} (d_model, train_length, length)"
           for k in sorted(set(at) - {"d_model", "train_length", "length"})]
    if "d_model" in at and at["d_model"] not in widths:
        bad.append(f"d_model {at['d_model']!r} is not one of the sweep's {widths}")
    if "train_length" in at and at["train_length"] not in train_lengths:
        bad.append(f"train_length {at['train_length']!r} is not one of the sweep's {train_lengths}")
    if "length" in at and not (is_int(at["length"]) or at["length"] in ("train", "longest")):
        bad.append(f"length must be an integer, train or longest, got {at['length']!r}")
    return bad

