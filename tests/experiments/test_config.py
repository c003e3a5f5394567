"""The declared config schemas: every problem of a config in one ConfigError, unknown keys named with
the valid ones, the shipped configs valid, values kept as written, and the help text and documentation
tables generated from the schemas with every key."""
from __future__ import annotations

import dataclasses

import pytest
import yaml
from finetune.helpers import make_checkpoint

from posattn.experiments.config import ConfigError, load_config, read_yaml, rows, schema_markdown, schema_text
from posattn.experiments.schemas import CONFIG_SCHEMAS
from posattn.finetune import suite
from posattn.finetune.run import FinetuneConfig
from posattn.finetune.schema import Training as FinetuneTraining
from posattn.pretrain import config as pretrain
from posattn.synthetic import compare
from posattn.synthetic.schema import Training as CompareTraining
from posattn.synthetic.train import TrainConfig

SWEEP = {"name": "s", "task": "mqar", "task_params": {"num_kv_pairs": 2}, "vocab_size": 16, "train_length": 16,
         "test_lengths": [16], "d_model": 16, "models": [{"mechanisms": ["rope"], "layers": 1}],
         "training": {"steps": 2, "batch_size": 4, "eval_every": 2}}


def problems(error: pytest.ExceptionInfo) -> list[str]:
    """The listed problems of a ConfigError ("invalid ...:\n  - a\n  - b")."""
    return [line.removeprefix("  - ") for line in str(error.value).splitlines()[1:]]


def test_every_bad_key_of_a_compare_config_in_one_error():
    bad = {**SWEEP, "vocab_size": "16", "seeds": [0, -1], "colour": "red", "dropout": 1.5,
           "examples": {"train": 0, "tests": 3},
           "models": [{"mechanisms": ["rotary"], "layer": 2}, {"mechanisms": ["rope"], "layers": [0]}],
           "training": {"steps": 0, "warmup": -5, "lr": [1e-3, "fast"], "epochs": 3}}
    with pytest.raises(ConfigError) as e:
        compare.validate_config(bad)
    found = problems(e)
    expected = ["vocab_size: must be a valid integer, got '16'",
                "seeds[1]: must be greater than or equal to 0, got -1",
                "dropout: must be less than 1, got 1.5",
                "examples.train: must be greater than or equal to 1, got 0",
                "examples: unknown key(s) tests; valid keys: train, valid, test",
                "models[0].mechanisms[0]: unknown mechanism 'rotary'; valid mechanisms: absolute,",
                "models[0]: unknown key(s) layer; valid keys: mechanisms, layers, label,",
                "models[1].layers[0]: must be greater than or equal to 1, got 0",
                "training.steps: must be greater than or equal to 1, got 0",
                "training.warmup: must be greater than or equal to 0, got -5",
                "training.lr[1]: must be a number, got 'fast'",
                "training: unknown key(s) epochs; valid keys: steps, batch_size, lr,",
                "unknown key(s) colour; valid keys: name, task, task_params,"]
    for line in expected:
        assert any(p.startswith(line) for p in found), line
    assert len(found) == len(expected)
    text = str(e.value)
    assert "pydantic" not in text and "Traceback" not in text and "For further information" not in text


@pytest.mark.parametrize("kind", ["compare", "finetune", "pretrain"])
def test_warmup_below_zero_is_refused(kind, tmp_path):
    if kind == "compare":
        check = lambda: compare.validate_config({**SWEEP, "training": {"warmup": -5}})     # noqa: E731
    elif kind == "finetune":
        ckpt = make_checkpoint(tmp_path / "ckpt")
        check = lambda: suite.validate_config({"checkpoints": [str(ckpt)], "tasks": ["word_order"],   # noqa: E731
                                               "task_training": {"word_order": {"warmup": -5}}})
    else:
        check = lambda: pretrain.parse({"warmup": -5})     # noqa: E731
    with pytest.raises(ConfigError, match=r"warmup: must be greater than or equal to 0, got -5"):
        check()


def test_unknown_keys_name_the_valid_ones_at_every_level():
    cases = [
        (lambda: compare.validate_config({**SWEEP, "optimiser": "sgd"}),
         "unknown key(s) optimiser; valid keys: " + ", ".join(CONFIG_SCHEMAS["compare"].model_fields)),
        (lambda: compare.validate_config({**SWEEP, "training": {"epoch": 1, "stepz": 3}}),
         "training: unknown key(s) epoch, stepz; valid keys: " + ", ".join(CompareTraining.model_fields)),
        (lambda: suite.validate_config({"checkpoints": [{"path": "x", "name": "y"}]}),
         "checkpoints[0]: unknown key(s) name; valid keys: path, label"),
        (lambda: suite.validate_config({"task_training": {"rte": {"lrr": 1}}}),
         "task_training.rte: unknown key(s) lrr; valid keys: " + ", ".join(FinetuneTraining.model_fields)),
        (lambda: pretrain.parse({"stepz": 1}),
         "unknown key(s) stepz; valid keys: " + ", ".join(CONFIG_SCHEMAS["pretrain"].model_fields)),
    ]
    for check, message in cases:
        with pytest.raises(ConfigError) as e:
            check()
        assert message in problems(e), (message, problems(e))


def test_the_shipped_configs_validate(tmp_path):
    for name in compare.builtin_configs():
        assert compare.validate_config(compare.load_config(name)).cells
    for name in pretrain.builtin_configs():
        recipe, runs = pretrain.load(name)
        assert recipe == name and runs
    ckpt = make_checkpoint(tmp_path / "ckpt")
    glue = tmp_path / "glue"
    glue.mkdir()
    for name in suite.builtin_configs():
        raw = {**suite.load_config(name), "checkpoints": [str(ckpt)], "glue_dir": str(glue)}
        assert suite.validate_config(raw).cells


def test_values_are_kept_as_written():
    """An integer stays an integer and a float a float: cells are identified by a hash of their settings."""
    sweep = compare.validate_config({**SWEEP, "training": {"warmup": 1, "weight_decay": 0, "lr": 1}})
    training = sweep.cells[0].training
    assert type(training["warmup"]) is int and type(training["weight_decay"]) is int
    assert training["lr"] == 1.0 and type(training["lr"]) is float        # lr is recorded as a float, as before
    cfg = pretrain.parse({"lr": 0.5, "warmup": 10, "betas": [0, 0.5]})
    assert cfg.to_dict()["warmup"] == 10 and type(cfg.warmup) is int and cfg.betas == [0, 0.5]


def test_strings_and_booleans_are_not_numbers():
    with pytest.raises(ConfigError) as e:
        compare.validate_config({**SWEEP, "d_model": True, "training": {"lr": "1e-3", "steps": 2.0}})
    found = problems(e)
    assert "d_model[0]: must be a valid integer, got True" in found
    assert "training.lr[0]: must be a number, got '1e-3'" in found
    assert "training.steps: must be a valid integer, got 2.0" in found


def test_the_training_schemas_mirror_the_run_configs():
    """Each schema declares every field of the dataclass its runs are built from, with the same default."""
    for schema, dataclass_, skip in ((CompareTraining, TrainConfig, {"seed"}),
                                     (FinetuneTraining, FinetuneConfig, {"seed"}),
                                     (CONFIG_SCHEMAS["pretrain"], pretrain.PretrainConfig, set())):
        declared = [f for f in dataclasses.fields(dataclass_) if f.name not in skip]
        assert list(schema.model_fields) == [f.name for f in declared], schema
        for f in declared:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            field = schema.model_fields[f.name]
            got = field.default_factory() if field.default_factory else field.default
            assert got == default or (f.name == "lr" and got == [default]), (schema, f.name)


@pytest.mark.parametrize("kind", sorted(CONFIG_SCHEMAS))
def test_help_and_documentation_list_every_key_with_its_meaning(kind):
    schema = CONFIG_SCHEMAS[kind]
    table = schema_markdown(schema)
    text = schema_text(schema, "Config schema")
    keys = [row.key for row in rows(schema)]
    assert set(schema.model_fields) <= set(keys)
    for row in rows(schema):
        assert row.meaning, f"{kind}: {row.key} has no description"
        assert f"| `{row.key}` | `{row.type.replace('|', chr(92) + '|')}` | " in table
        assert f"{row.key.rsplit('.', 1)[-1]}: {row.type}" in text
    assert table.startswith("| key | type | default | meaning |\n|---|---|---|---|\n")
    assert len(table.splitlines()) == 2 + len(keys)


def test_the_commands_help_is_the_schema_text():
    assert compare.schema_text() == schema_text(CONFIG_SCHEMAS["compare"], "Config schema")
    assert suite.schema_text() == schema_text(CONFIG_SCHEMAS["finetune"], "Config schema")
    assert pretrain.schema_text() == schema_text(CONFIG_SCHEMAS["pretrain"], "Config schema")
    docs = schema_markdown(CONFIG_SCHEMAS["finetune"])
    assert "| `training.lr` | `number` | `0.0003` |" in docs and "Chang et al. 2021, Table 5" in docs
    assert "| `models[].layers` | `int \\| [int]` | `[2]` |" in schema_markdown(CONFIG_SCHEMAS["compare"])
    assert "| `task_training` |" in docs and "task_training.<key>" not in docs     # the keys of training


def test_yaml_is_read_one_way(tmp_path):
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "broken.yaml").write_text("a: [1, 2\n")
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(SWEEP))
    with pytest.raises(ConfigError, match="list.yaml: the top level must be a mapping of config keys"):
        read_yaml(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="broken.yaml: not valid YAML"):
        read_yaml(tmp_path / "broken.yaml")
    with pytest.raises(ConfigError, match="missing.yaml: not a readable file"):
        read_yaml(tmp_path / "missing.yaml")
    assert read_yaml(tmp_path / "good.yaml") == SWEEP
    raw = load_config(str(tmp_path / "good.yaml"), package="posattn.synthetic", default="default")
    assert raw == SWEEP
    with pytest.raises(ConfigError, match="list.yaml: the top level must be a mapping"):
        load_config(str(tmp_path / "list.yaml"), package="posattn.synthetic", default="default")
    with pytest.raises(ConfigError, match="broken.yaml: not valid YAML"):
        pretrain.load(str(tmp_path / "broken.yaml"))


def test_yaml_refuses_a_key_given_twice_and_reads_exponents_as_numbers():
    from posattn.experiments.config import parse_yaml
    assert parse_yaml("lr: 1e-2\nwarmup: 1.0e-3\nsteps: 1_000\nname: '1e-2'\n", "c.yaml") == \
        {"lr": 0.01, "warmup": 0.001, "steps": 1000, "name": "1e-2"}
    with pytest.raises(ConfigError, match=r"c.yaml: not valid YAML: line 3, column 3: key 'lr' given twice"):
        parse_yaml("training:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", "c.yaml")
