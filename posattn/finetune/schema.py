"""The schema of a ``posattn finetune`` config: every key, its type, default and meaning, and every check.

:class:`FinetuneSuiteConfig` is the one declaration the config is validated against (all problems
at once, see :func:`posattn.experiments.config.check`) and that ``posattn finetune --help`` and the
documentation print. A check that combines keys (GLUE tasks and ``glue_dir``, ``max_seq_len`` and
the checkpoints' positions, ``intermediate`` and the tasks) runs in the later key's validator once
the keys it reads are valid. :mod:`posattn.finetune.suite` expands a valid config into cells.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..errors import PositionError
from ..experiments.config import Name, Number, Schema, Shown, report, several
from ..experiments.fields import Claims, ExecutorBlock, executor_field
from ..models import build_model
from .run import FinetuneConfig, check_encoder, find_checkpoint, tokenizer_path
from .tasks import GLUE_SUITE, OFFLINE_SUITE, TASKS

SUITES = {"offline": list(OFFLINE_SUITE), "glue": list(GLUE_SUITE)}
CHANG = "Chang et al. 2021, Table 5"


def _empty_if_none(value: Any) -> Any:
    return {} if value is None else value


def _path_entry(value: Any) -> Any:
    if isinstance(value, (str, Path)):
        return {"path": str(value)}
    if isinstance(value, dict) and isinstance(value.get("path"), Path):
        return {**value, "path": str(value["path"])}
    return value


def _seed_count(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"must be a positive integer (that many seeds, 0..n-1) or a list of integers >= 0, "
                             f"got {value}")
        return list(range(value))
    return value


class Training(Schema):
    """Optimisation settings of a fine-tuning run (:class:`posattn.finetune.run.FinetuneConfig`, its ``seed``
    aside: that comes from ``seeds``). A key given here overrides the task's default; the defaults are
    Chang et al.'s (2021, Table 5)."""

    lr: Number = Field(FinetuneConfig.lr, gt=0, description=f"peak learning rate of AdamW; default per task "
                                                            f"({CHANG}): 3e-4, QNLI 1e-4")
    batch_size: int = Field(FinetuneConfig.batch_size, ge=1, description=f"examples per optimizer step; default "
                                                                         f"per task ({CHANG}): 32, MNLI and QQP 128")
    epochs: Number = Field(FinetuneConfig.epochs, gt=0, description=f"passes over the training set; default per "
                                                                    f"task ({CHANG}): 3, RTE and STS-B 10, MNLI and "
                                                                    f"QQP 4")
    warmup: Number = Field(FinetuneConfig.warmup, ge=0, description=f"linear warmup, a fraction of the steps below "
                                                                    f"1, else a number of steps; then linear decay "
                                                                    f"to 0 ({CHANG})")
    weight_decay: Number = Field(FinetuneConfig.weight_decay, ge=0, description=f"AdamW weight decay ({CHANG})")
    adam_eps: Number = Field(FinetuneConfig.adam_eps, gt=0, description=f"Adam epsilon ({CHANG})")
    dropout: Number = Field(FinetuneConfig.dropout, ge=0, lt=1, description=f"dropout probability ({CHANG})")
    grad_clip: Number = Field(FinetuneConfig.grad_clip, ge=0, description="gradient norm clipping (0: none)")
    evals_per_epoch: int = Field(FinetuneConfig.evals_per_epoch, ge=1,
                                 description="validation evaluations per epoch; the best one is kept")
    patience: int | None = Field(FinetuneConfig.patience, ge=1, description="stop after that many evaluations "
                                                                            "without improvement (null: train "
                                                                            "every epoch)")
    eval_batch_size: int = Field(FinetuneConfig.eval_batch_size, ge=1, description="examples per evaluation batch")

    def given(self) -> dict[str, Any]:
        """The keys the config gives, in the schema's order (the others are the task's defaults)."""
        return {k: getattr(self, k) for k in type(self).model_fields if k in self.model_fields_set}


class Checkpoint(Schema):
    """A pretrained encoder to fine-tune: a model folder or a ``posattn pretrain`` run folder."""

    path: str = Field(description="the model folder (config.json, weights, tokenizer.json beside them or in the "
                                  "folder above), or a run folder holding model/")
    label: str | None = Field(None, description="row name in the report (default: the mechanism names)")
    _folder: Path = PrivateAttr()
    _config: dict[str, Any] = PrivateAttr()

    @model_validator(mode="after")
    def _readable(self) -> Checkpoint:
        try:
            self._folder = find_checkpoint(self.path)
            self._config = check_encoder(self._folder)
            tokenizer_path(self._folder)
        except PositionError as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def folder(self) -> Path:
        return self._folder

    @property
    def config(self) -> dict[str, Any]:
        """The checkpoint's model config."""
        return self._config

    @property
    def row(self) -> str:
        """The report's row name: the label, else the mechanism names, else the folder's name."""
        names = "+".join(m if isinstance(m, str) else str(m.get("name")) for m in self._config.get("mechanisms", []))
        return str(self.label or names or self._folder.name)


class FinetuneSuiteConfig(Schema):
    """Every combination of checkpoint, task and seed is one cell: the checkpoint fine-tuned on the task.
    Cells of an intermediate task (MNLI) run first and keep their model; the cells they initialise run
    after them with the same checkpoint and seed.

    Per-task defaults (Chang et al. 2021, Table 5): lr 3e-4 (QNLI 1e-4), batch 32 (MNLI, QQP 128), epochs 3
    (RTE, STS-B 10; MNLI, QQP 4), warmup 10% then linear decay, dropout 0.1, weight decay 0, Adam eps 1e-6;
    the best validation evaluation is kept."""

    name: Name = Field("offline", description="suite name; default output folder runs/finetune-<name>")
    checkpoints: list[Annotated[Checkpoint, BeforeValidator(_path_entry)]] = Field(
        default_factory=list, validate_default=True, json_schema_extra={"shown_default": "required"},
        description="the pretrained encoders, each a path or {path, label}; CHECKPOINT arguments on the command "
                    "line replace the list")
    tasks: several(str, "str") = Field(
        default_factory=lambda: ["offline"], validate_default=True,
        description=f"task names, or a suite: offline ({', '.join(OFFLINE_SUITE)}) or glue (Chang's eight: "
                    f"{', '.join(GLUE_SUITE)}); GLUE tasks (wnli too) need glue_dir")
    seeds: Annotated[list[Annotated[int, Field(ge=0)]], BeforeValidator(_seed_count), Field(min_length=1),
                     Shown("int | [int]")] = Field(
        default_factory=lambda: [0, 1, 2], description="seeds of the runs; an integer n means seeds 0..n-1")
    glue_dir: str | None = Field(None, validate_default=True,
                                 description="folder of the official GLUE download (CoLA/, SST-2/, MNLI/, ...); "
                                             "nothing is downloaded")
    max_train: int | None = Field(None, ge=2, description="cap on training examples per task (a fixed subset; "
                                                          "null: all)")
    max_eval: int | None = Field(None, ge=2, description="cap on the validation set and on each test set")
    max_seq_len: int | None = Field(None, ge=4, description="tokens per input, truncated longest first (null: "
                                                            "the model's max_len); above max_len only for models "
                                                            "whose every mechanism is inductive")
    training: Annotated[Training, BeforeValidator(_empty_if_none)] = Field(
        default_factory=Training, description="overrides of the task defaults for every task")
    task_training: Annotated[dict[str, Training], BeforeValidator(_empty_if_none)] = Field(
        default_factory=dict, description="overrides for one task: {task: {key: value}}, with the keys of training")
    intermediate: Annotated[Any, Shown("auto | {task: source task}")] = Field(
        "auto", validate_default=True,
        description=f"tasks whose run starts from another task's fine-tuned model; auto: RTE, STS-B and MRPC "
                    f"start from MNLI when both are in the suite ({CHANG}); {{}} turns it off")
    cell_store: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="folder of the cells (null: <out>/cells); suites naming the same folder share "
                          "finished cells, keyed by checkpoint content, task, seed and settings")
    claims: Claims = Field(
        None, description="papers' rankings of rows, judged on the suite scores in report.md (posattn.claims): "
                          "[{claim: str, paper: str, holds: ['A > B', 'A !> B', ...]}]")
    executor: ExecutorBlock = executor_field()

    @field_validator("checkpoints")
    @classmethod
    def _checkpoints(cls, checkpoints: list[Checkpoint]) -> list[Checkpoint]:
        if not checkpoints:
            raise ValueError("no checkpoint: give CHECKPOINT folder(s) on the command line or a `checkpoints` list")
        labels = [c.row for c in checkpoints]
        dupes = sorted({lab for lab in labels if labels.count(lab) > 1})
        if dupes:
            raise ValueError(f"duplicate label(s) {', '.join(dupes)}; give them distinct labels")
        return checkpoints

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, given: list[str]) -> list[str]:
        """The task names, the suites expanded, each once."""
        names: list[str] = []
        problems = []
        for name in (n for t in given for n in SUITES.get(t, [t])):
            if name not in TASKS:
                problems.append(f"tasks: unknown task {name!r}; tasks: {', '.join(TASKS)} (or offline, glue)")
            elif name not in names:
                names.append(name)
        report(problems)
        return names

    @field_validator("glue_dir")
    @classmethod
    def _glue_dir(cls, glue_dir: str | None, info: ValidationInfo) -> str | None:
        glue = [n for n in info.data.get("tasks", []) if TASKS[n].source == "glue"]
        if glue and not glue_dir:
            raise ValueError(f"GLUE task(s) {', '.join(glue)} need glue_dir (--glue-dir: the folder of the official "
                             f"GLUE download); nothing is downloaded")
        if glue_dir and not Path(glue_dir).is_dir():
            raise ValueError(f"{glue_dir}: no such folder")
        return glue_dir

    @field_validator("max_seq_len")
    @classmethod
    def _max_seq_len(cls, asked: int | None, info: ValidationInfo) -> int | None:
        problems = []
        for ckpt in info.data.get("checkpoints", []) if asked is not None else []:
            cfg = ckpt.config
            if asked > cfg["max_len"]:
                fixed = [m.name for m in build_model(cfg).mechanisms() if not m.inductive]
                if fixed:
                    problems.append(f"max_seq_len {asked}: {ckpt.row} was built for {cfg['max_len']} positions and "
                                    f"{', '.join(fixed)} cannot go beyond them (not inductive); use at most "
                                    f"{cfg['max_len']}")
        report(problems)
        return asked

    @field_validator("task_training")
    @classmethod
    def _task_training(cls, per_task: dict[str, Training]) -> dict[str, Training]:
        report([f"task_training: unknown task {name!r}" for name in sorted(set(per_task) - set(TASKS))])
        return per_task

    @field_validator("intermediate")
    @classmethod
    def _intermediate(cls, intermediate: Any, info: ValidationInfo) -> dict[str, str]:
        """The mapping task -> source task (``auto`` resolved)."""
        if "tasks" not in info.data:
            return {}
        tasks = info.data["tasks"]
        if intermediate == "auto":
            return {t: TASKS[t].init_from for t in tasks if TASKS[t].init_from in tasks}
        if not isinstance(intermediate, dict):
            raise ValueError(f"must be auto or a mapping task: source task, got {intermediate!r}")
        report([f"intermediate: {t} <- {src} needs both tasks in the suite, distinct, and a source that is not "
                f"itself initialised from another task"
                for t, src in intermediate.items()
                if t not in tasks or src not in tasks or t == src or src in intermediate])
        return dict(intermediate)

    def max_seq_len_of(self, ckpt: Checkpoint) -> int:
        """Tokens per input for one checkpoint: max_seq_len, else the model's max_len."""
        return int(self.max_seq_len if self.max_seq_len is not None else ckpt.config["max_len"])

