"""`posattn mechanisms` and `posattn mechanisms --json`."""
from __future__ import annotations

import json

import posattn
from posattn.cli import main
from posattn.mechanisms import Dims, properties

KEYS = {"name", "acts_on", "inductive", "translation_invariant", "positional_params", "paper"}


def run_json(capsys, *args):
    assert main(["mechanisms", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_every_mechanism_with_required_keys(capsys):
    rows = run_json(capsys)
    assert [r["name"] for r in rows] == posattn.names()
    for r in rows:
        assert KEYS <= set(r), r["name"]
        assert isinstance(r["acts_on"], list) and set(r["acts_on"]) <= {"input", "q", "k", "v", "score", "output",
                                                                         "mixer"}
        assert isinstance(r["inductive"], bool) and isinstance(r["translation_invariant"], bool)
        assert isinstance(r["decoder"], bool)
        assert isinstance(r["positional_params"], int) and r["positional_params"] >= 0
        assert isinstance(r["paper"], str) and r["paper"]


def test_json_is_computed_for_the_given_model(capsys):
    rows = {r["name"]: r for r in run_json(capsys, "--d-model", "32", "--heads", "4", "--layers", "2",
                                          "--max-len", "64")}
    assert rows["absolute"]["positional_params"] == 64 * 32
    assert rows["tisa"]["positional_params"] == 3 * 5 * 4 * 2
    assert rows["t5"]["positional_params"] == 32 * 4
    assert rows["fixed_conv"]["positional_params"] == 4 * 17 * 2
    # the same numbers as the library's properties() (what the behavioural tests check)
    d = Dims(32, 4, 2, 64, 2, False)
    for name, row in rows.items():
        want = properties(name, d)
        assert {k: row[k] for k in KEYS} == {k: want[k] for k in KEYS}
    # defaults: BERT-base sizes (TISA Table 2: 512·768 absolute, 3·5·12·12 TISA)
    base = {r["name"]: r for r in run_json(capsys)}
    assert base["absolute"]["positional_params"] == 512 * 768
    assert base["tisa"]["positional_params"] == 2160
    # a decoder counts causal filters: depthwise_conv keeps (17 + 1) / 2 taps
    dec = {r["name"]: r for r in run_json(capsys, "--decoder")}
    assert dec["depthwise_conv"]["positional_params"] == 768 * 9 * 12
    assert base["depthwise_conv"]["positional_params"] == 768 * 17 * 12


def test_table(capsys):
    assert main(["mechanisms", "--d-model", "32", "--heads", "4", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "d_model=32" in lines[0]
    header = lines[1].split()
    assert header[:2] == ["name", "acts"]
    body = {line.split()[0]: line for line in lines[3:]}
    assert list(body) == posattn.names()
    assert body["absolute"].split()[1:4] == ["input", "no", "no"]
    assert body["tisa"].split()[1:5] == ["score", "yes", "yes", "120"]
    assert body["none"].split()[1] == "-"
    assert "Wennberg & Henter 2021" in body["tisa"]
