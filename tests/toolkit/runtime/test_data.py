"""`toolkit data prepare` and the runtime's data path, checked against megatron-core's own
IndexedDataset / GPTDataset readers and a tokenizer made here with `tokenizers`."""
import json

import numpy
import pytest
import torch

from toolkit.cli import main
from toolkit.errors import InputFileError, OutputExistsError, SpecError
from toolkit.runtime import data

DOCS = ["the cat sat on the mat", "a dog ran after the cat", "count one two three four five six",
        "the mat was red and the dog was brown"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A word-level HF tokenizer folder built on the fly (tokenizers + transformers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    out = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(out)
    return out


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def test_prepare_jsonl_matches_tokenizer(tmp_path, tokenizer):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    info = data.prepare(write_jsonl(tmp_path / "in.jsonl", DOCS), tokenizer, tmp_path / "out" / "ds")
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    expect = [tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in DOCS]
    ds = IndexedDataset(str(tmp_path / "out" / "ds"))
    assert len(ds) == len(DOCS) == info.documents
    assert [ds[i].tolist() for i in range(len(ds))] == expect
    assert ds[0].dtype == numpy.uint16 and info.tokens == sum(map(len, expect))
    assert data.dataset_info(tmp_path / "out" / "ds") == info and info.eod == tok.eos_token_id


def test_prepare_txt_splits_on_blank_lines(tmp_path, tokenizer):
    src = tmp_path / "in.txt"
    src.write_text("the cat sat\non the mat\n\n\n\na dog ran\n")
    info = data.prepare(src, tokenizer, tmp_path / "t")
    assert info.documents == 2


def test_prepare_refuses_and_leaves_nothing(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    data.prepare(src, tokenizer, tmp_path / "ds")
    with pytest.raises(OutputExistsError, match="already exists"):
        data.prepare(src, tokenizer, tmp_path / "ds")
    data.prepare(src, tokenizer, tmp_path / "ds", overwrite=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat"}\n{"txt": "oops"}\n')
    with pytest.raises(InputFileError, match="bad.jsonl:2"):
        data.prepare(bad, tokenizer, tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "ds.bin", "ds.idx", "ds.json", "in.jsonl"]
    with pytest.raises(InputFileError, match="expected a .jsonl or .txt"):
        data.prepare(tmp_path / "ds.json", tokenizer, tmp_path / "c")


def test_cli_prepare(tmp_path, tokenizer, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    argv = ["data", "prepare", str(src), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "ds")]
    assert main(argv) == 0
    assert "4 documents" in capsys.readouterr().out
    assert main(argv) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(argv + ["--overwrite"]) == 0
    assert main(["data", "prepare", str(tmp_path / "none.jsonl"), "--tokenizer", str(tokenizer),
                 "--out", str(tmp_path / "x")]) == 3


def test_gpt_dataset_and_vocab_check(tmp_path, tokenizer):
    """megatron-core's GPTDataset over the prepared file: labels are tokens shifted by one."""
    prefix = tmp_path / "ds"
    data.prepare(write_jsonl(tmp_path / "in.jsonl", DOCS * 20), tokenizer, prefix)
    data.check_dataset(prefix, vocab_size=512)
    with pytest.raises(SpecError, match="tokenized with"):
        data.check_dataset(prefix, vocab_size=8)
    with pytest.raises(InputFileError, match="toolkit data prepare"):
        data.check_dataset(tmp_path / "missing", vocab_size=512)
    ds = data.build_dataset(prefix, seq_len=8, seed=1, vocab_size=512, cache_dir=tmp_path / "cache")
    n = len(ds)
    assert n == (sum(len(d.split()) + 1 for d in DOCS) * 20 - 1) // 8, "one epoch of seq_len + 1 samples"
    batch = data.collate(ds, [0, 1, n + 1], "cpu")
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (3, 8) for k in batch}
    assert torch.equal(batch["tokens"][2], ds[1]["tokens"]), "sample n + 1 is sample 1 of the next epoch"
    s = ds[5]
    assert s["tokens"][1:].tolist() == s["labels"][:-1].tolist()


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sample_ids_are_the_global_batch_whatever_dp(dp):
    """Megatron-LM's sampler: the batch after 48 consumed samples covers [48, 64) for any
    data-parallel size."""
    micro, glob = 2, 16
    ids = [i for r in range(dp) for mb in data.sample_ids(48, micro, glob, dp, r) for i in mb]
    assert sorted(ids) == list(range(48, 64))
    assert len(data.sample_ids(48, micro, glob, dp, 0)) == glob // (micro * dp)


def test_shipped_builtin_corpus_is_what_prepare_writes(tmp_path):
    """The built-in corpus is shipped tokenised (toolkit/runtime/corpus/tiny_corpus.*) and copied
    into each run (trainer.dataset_prefix): its bytes must be what `prepare` writes from the shipped
    text and tokenizer today, and the copy's json names the tokenizer's absolute path as prepare's does.
    After a change to either: python -c "from toolkit.runtime import data, trainer as t;
    data.prepare(t.CORPUS / 'tiny_corpus.txt', t.CORPUS / 'tokenizer', t.CORPUS / 'tiny_corpus', overwrite=True)"
    then set the json's "tokenizer" to "tokenizer"."""
    from toolkit.runtime.trainer import CORPUS

    made, copied = tmp_path / "made", tmp_path / "run" / "data" / "tiny_corpus"
    data.prepare(CORPUS / "tiny_corpus.txt", CORPUS / "tokenizer", made)
    data.copy_prepared(CORPUS / "tiny_corpus", CORPUS / "tokenizer", copied)
    for suffix in (".bin", ".idx"):
        assert (CORPUS / f"tiny_corpus{suffix}").read_bytes() == (tmp_path / f"made{suffix}").read_bytes(), suffix
        assert (tmp_path / f"made{suffix}").read_bytes() == copied.with_suffix(suffix).read_bytes(), suffix
    assert json.loads((tmp_path / "made.json").read_text()) == json.loads(copied.with_suffix(".json").read_text())
    assert json.loads((CORPUS / "tiny_corpus.json").read_text())["tokenizer"] == "tokenizer"
    assert sorted(p.name for p in copied.parent.iterdir()) == ["tiny_corpus.bin", "tiny_corpus.idx", "tiny_corpus.json"]
