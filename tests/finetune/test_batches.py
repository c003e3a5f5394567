"""BERT input format, longest-first truncation, length-sorted evaluation batches."""
from posattn.finetune.batches import encode_examples, eval_batches, padded_tokens, truncate_pair
from posattn.finetune.tasks import OFFLINE, POSITION, Example
from posattn.text.tokenizer import encode, special_ids

from .helpers import SENTENCES, tokenizer


def test_single_and_pair_layout_with_segments():
    tok = tokenizer()
    sp = special_ids(tok)
    a, b = encode(tok, SENTENCES[:2])
    single = encode_examples(tok, OFFLINE["trec6"], [Example(SENTENCES[0], None, 3)], 64)
    assert single.ids == [[sp.cls, *a, sp.sep]] and single.segments == [[0] * (len(a) + 2)]
    pair = encode_examples(tok, POSITION["sentence_order"], [Example(SENTENCES[0], SENTENCES[1], 1)], 64)
    assert pair.ids == [[sp.cls, *a, sp.sep, *b, sp.sep]]
    assert pair.segments == [[0] * (len(a) + 2) + [1] * (len(b) + 1)]
    assert pair.truncated == 0 and pair.labels.tolist() == [1]


def test_truncation_is_longest_first_and_counted():
    a, b = list(range(10)), list(range(4))
    assert truncate_pair(a, b, 8) and (len(a), len(b)) == (4, 4)
    a, b = list(range(10)), list(range(4))
    assert truncate_pair(a, b, 12) and a == list(range(8)) and b == list(range(4))
    tok = tokenizer()
    enc = encode_examples(tok, POSITION["same_order"], [Example(SENTENCES[2], SENTENCES[3], 0),
                                                      Example("a dog", "a cat", 1)], 12)
    assert max(enc.lengths()) == 12 and enc.truncated == 1


def test_sorted_eval_batches_cover_everything_with_less_padding():
    lengths = [5, 40, 6, 38, 7, 41, 5, 39]
    batches = eval_batches(lengths, 2)
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert padded_tokens(lengths, batches) < padded_tokens(lengths, eval_batches(lengths, 2, sort=False))
    assert padded_tokens(lengths, batches) == 5 + 5 + 7 + 7 + 39 + 39 + 41 + 41
