"""The packed-documents memory benchmark at tiny sizes, in this process (its rows spawn a process each): the dense
path allocates [seq, seq] tensors and the packed path none, with the same loss; bad document lengths are refused."""
import queue

import pytest

from bench.packed_attention_memory import _step, document_lengths, parse_args


def test_both_rows_at_tiny_sizes():
    # seq 160: no other dimension of the model (hidden 32, its MLP 128, vocabulary 1024) is the sequence's
    args = parse_args(["--seq", "160", "--shortest", "8", "--longest", "40", "--layers", "1", "--hidden", "32"])
    assert sum(document_lengths(160, 8, 40)) == 160
    results = {}
    for packed in (False, True):
        out = queue.Queue()
        _step(args, packed, out)
        results[packed] = out.get()  # (peak MB, largest [seq, seq] MB, seconds, loss)
    assert results[False][1] > 0 and results[True][1] == 0, results
    assert abs(results[False][3] - results[True][3]) < 1e-5, results


def test_bad_document_lengths_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--shortest", "100", "--longest", "10"])
    assert "need 1 <= shortest <= longest" in capsys.readouterr().err
