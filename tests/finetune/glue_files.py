"""Write small GLUE task folders in the official layout (``download_glue_data.py``), for tests."""
from __future__ import annotations

import random
from pathlib import Path

WORDS = "the a dog cat saw chased man woman park ran quickly house old new big red \"quoted\" it's".split()

MNLI_TRAIN = ("index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
              "sentence2_parse sentence1 sentence2 label1 gold_label").split()
MNLI_DEV = MNLI_TRAIN[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]
HEADERS = {
    "SST-2": ["sentence", "label"],
    "MRPC": ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    "STS-B": "index genre filename year old_index source1 source2 sentence1 sentence2 score".split(),
    "QQP": "id qid1 qid2 question1 question2 is_duplicate".split(),
    "QNLI": "index question sentence label".split(),
    "RTE": "index sentence1 sentence2 label".split(),
    "WNLI": "index sentence1 sentence2 label".split(),
}
LABELS = {"SST-2": ["0", "1"], "MRPC": ["0", "1"], "QQP": ["0", "1"], "WNLI": ["0", "1"],
          "QNLI": ["entailment", "not_entailment"], "RTE": ["entailment", "not_entailment"],
          "MNLI": ["contradiction", "entailment", "neutral"], "CoLA": ["0", "1"]}


def sentence(rng: random.Random, n: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def row(folder: str, header: list[str], rng: random.Random) -> tuple[list[str], tuple]:
    """One row in ``header``'s layout and the (a, b, label) it holds."""
    if folder == "STS-B":
        label = f"{rng.uniform(0, 5):.3f}"
    else:
        label = rng.choice(LABELS[folder])
    a, b = sentence(rng), sentence(rng)
    names = {"sentence": a, "#1 String": a, "sentence1": a, "question1": a, "question": a,
             "#2 String": b, "sentence2": b, "question2": b, "label": label, "Quality": label, "score": label,
             "is_duplicate": label, "gold_label": label}
    if folder == "QNLI":
        names["sentence"] = b
    cells = [names.get(h, str(rng.randrange(1000))) for h in header]
    return cells, (a, None if folder == "SST-2" else b, label)


def write_glue(root: Path, n: int = 40, seed: int = 0) -> dict[str, dict[str, list[tuple]]]:
    """All nine task folders under ``root``; returns, per folder and file, the (a, b, label) written."""
    rng, written = random.Random(seed), {}
    files = {f: {"train.tsv": HEADERS[f], "dev.tsv": HEADERS[f]} for f in HEADERS}
    files["MNLI"] = {"train.tsv": MNLI_TRAIN, "dev_matched.tsv": MNLI_DEV, "dev_mismatched.tsv": MNLI_DEV}
    for folder, by_file in files.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        written[folder] = {}
        for name, header in by_file.items():
            rows = [row(folder, header, rng) for _ in range(n)]
            lines = ["\t".join(header), *("\t".join(cells) for cells, _ in rows)]
            (root / folder / name).write_text("\n".join(lines) + "\n")
            written[folder][name] = [x for _, x in rows]
    (root / "CoLA").mkdir(parents=True, exist_ok=True)
    written["CoLA"] = {}
    for name in ("train.tsv", "dev.tsv"):
        rows = [(sentence(rng), rng.choice("01")) for _ in range(n)]
        text = "".join(f"gj04\t{lab}\t{'' if lab == '1' else '*'}\t{s}\n" for s, lab in rows)
        (root / "CoLA" / name).write_text(text)
        written["CoLA"][name] = [(s, None, lab) for s, lab in rows]
    return written
