"""GLUE loaders on small files written in the official layout; bad files give one clear error."""
import pytest

from posattn.finetune import glue
from posattn.finetune.tasks import GLUE, TaskError

from .glue_files import write_glue


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue")
    return root, write_glue(root)


def as_written(task, ex):
    label = f"{ex.label:.3f}" if task.regression else task.labels[ex.label]
    return ex.a, ex.b, label


@pytest.mark.parametrize("name", list(glue.LAYOUTS))
def test_every_file_reads_back_exactly(glue_dir, name):
    root, written = glue_dir
    layout, task = glue.LAYOUTS[name], GLUE[name]
    for file in ["train.tsv", *layout.eval_files.values()]:
        examples = glue.read_file(name, root / layout.folder / file)
        assert [as_written(task, e) for e in examples] == written[layout.folder][file]


@pytest.mark.parametrize("name", list(glue.LAYOUTS))
def test_load_splits_train_into_train_and_valid_and_scores_dev(glue_dir, name):
    root, written = glue_dir
    data = glue.load_glue(name, root)
    layout = glue.LAYOUTS[name]
    assert len(data.train) + len(data.valid) == len(written[layout.folder]["train.tsv"])
    assert data.valid and data.train
    assert set(data.test) == set(layout.eval_files)
    assert all(len(v) == len(written[layout.folder][layout.eval_files[k]]) for k, v in data.test.items())
    again = glue.load_glue(name, root)
    assert again.train == data.train and again.valid == data.valid          # fixed split


def test_mnli_has_matched_and_mismatched_columns(glue_dir):
    data = glue.load_glue("mnli", glue_dir[0])
    assert data.task.columns() == ["MNLI-m", "MNLI-mm"] and set(data.test) == {"m", "mm"}


def test_caps_keep_a_fixed_subset(glue_dir):
    data = glue.load_glue("sst2", glue_dir[0], max_train=10, max_eval=5)
    assert len(data.train) == 10 and len(data.test["test"]) == 5 and len(data.valid) <= 5
    assert set(data.train) <= set(glue.load_glue("sst2", glue_dir[0]).train)


def corrupt(tmp_path, folder, file, line_no, new_line):
    root = tmp_path / "g"
    write_glue(root, n=10)
    path = root / folder / file
    lines = path.read_text().splitlines()
    lines[line_no - 1] = new_line
    path.write_text("\n".join(lines) + "\n")
    return root, path


@pytest.mark.parametrize("task, folder, file, line_no, new_line, message", [
    ("rte", "RTE", "train.tsv", 4, "7\tonly two columns", "2 tab-separated columns, expected 4"),
    # CoLA has no header: its column count is checked all the same
    ("cola", "CoLA", "dev.tsv", 3, "gj04\t1\tno judgement column", "3 tab-separated columns, expected 4"),
    ("qnli", "QNLI", "dev.tsv", 2, "1\tq\ts\tmaybe", "unknown label 'maybe'.*entailment, not_entailment"),
    ("stsb", "STS-B", "train.tsv", 5, "\t".join(["x"] * 10), "label 'x' is not a number"),
    ("sst2", "SST-2", "train.tsv", 1, "text\tlabel", "header lacks column.*'sentence'"),
])
def test_bad_line_error_names_file_and_line(tmp_path, task, folder, file, line_no, new_line, message):
    root, path = corrupt(tmp_path, folder, file, line_no, new_line)
    with pytest.raises(TaskError, match=f"{path}:{line_no}: {message}"):
        glue.load_glue(task, root)


def test_empty_and_missing_files(tmp_path):
    root = tmp_path / "g"
    write_glue(root, n=10)
    (root / "MRPC" / "dev.tsv").write_text("\t".join(["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]) + "\n")
    with pytest.raises(TaskError, match="MRPC/dev.tsv: no examples"):
        glue.load_glue("mrpc", root)
    (root / "QQP" / "dev.tsv").unlink()
    with pytest.raises(TaskError, match="QQP/dev.tsv: no such file.*official GLUE layout"):
        glue.load_glue("qqp", root)
    with pytest.raises(TaskError, match="no such folder"):
        glue.load_glue("rte", tmp_path / "nowhere")
