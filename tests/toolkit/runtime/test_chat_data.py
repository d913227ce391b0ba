"""Chat data: conversations rendered with real chat templates (transformers), the assistant
mask checked against transformers' own ({% generation %}), stored as megatron-core indexed
datasets (read back with megatron's IndexedDataset)."""
import json

import pytest

from toolkit.cli import main
from toolkit.errors import InputFileError
from toolkit.runtime import chat_corpus as cc
from toolkit.runtime import data
from toolkit.runtime.chat_template import tokenize_conversation

CONVS = cc.conversations(40, seed=3)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat_tok")
    made = {name: cc.make_tokenizer(root / name, t)
            for name, t in (("chatml", cc.CHATML), ("generation", cc.CHATML_GENERATION), ("llama3", cc.LLAMA3))}
    return {name: (path, AutoTokenizer.from_pretrained(str(path))) for name, path in made.items()}


def messages(record):
    from toolkit.runtime.chat_template import messages_of

    return messages_of(record)


def test_derived_mask_is_transformers_mask(tokenizers):
    """On a template with {% generation %} blocks, the mask derived by rendering prefixes is
    token for token transformers' return_assistant_tokens_mask; the plain ChatML template
    (same rendering, no blocks) gives the same ids and mask."""
    _, gen = tokenizers["generation"]
    _, plain = tokenizers["chatml"]
    for record in CONVS:
        msgs = messages(record)
        ids, theirs = tokenize_conversation(gen, msgs, derive=False)
        assert sum(theirs) > 0
        assert tokenize_conversation(gen, msgs, derive=True) == (ids, theirs)
        assert tokenize_conversation(plain, msgs) == (ids, theirs)


def test_batched_is_one_at_a_time(tokenizers):
    """data prepare renders and tokenises a chunk of conversations per call: the same ids and
    masks as one conversation at a time, on both mask paths."""
    from toolkit.runtime.chat_template import tokenize_many

    convs = [messages(r) for r in CONVS]
    for name in ("chatml", "llama3", "generation"):
        _, tok = tokenizers[name]
        for derive in (True, False) if name == "generation" else (None,):
            assert tokenize_many(tok, convs, derive) == [tokenize_conversation(tok, m, derive) for m in convs]


def test_a_template_refusal_names_its_line(tmp_path, tokenizers):
    from transformers import AutoTokenizer

    strict = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
              "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}" + cc.CHATML)
    path, _ = tokenizers["chatml"]
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = strict
    tok.save_pretrained(tmp_path / "strict")
    bad = {"messages": [{"role": "narrator", "content": "the cat"}, {"role": "assistant", "content": "dog"}]}
    src = cc.write_jsonl(tmp_path / "c.jsonl", CONVS[:5] + [bad] + CONVS[5:])
    with pytest.raises(InputFileError, match=r"c.jsonl:6: the chat template refused this conversation: "
                                             r"unknown role narrator"):
        data.prepare(src, tmp_path / "strict", tmp_path / "out")
    assert not list(tmp_path.glob("out*"))


def test_a_first_assistant_message_keeps_its_header_out(tokenizers):
    """A conversation that opens with the assistant: the derived mask still starts at the reply
    (transformers' mask on the {% generation %} template agrees)."""
    msgs = [{"role": "assistant", "content": "the cat"}, {"role": "user", "content": "dog"},
            {"role": "assistant", "content": "red ball"}]
    _, gen = tokenizers["generation"]
    assert tokenize_conversation(gen, msgs, derive=True) == tokenize_conversation(gen, msgs, derive=False)
    _, tok = tokenizers["llama3"]
    ids, mask = tokenize_conversation(tok, msgs)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "the cat<|eot_id|>red ball<|eot_id|>"


@pytest.mark.parametrize("name,end", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_mask_keeps_exactly_the_replies(tokenizers, name, end):
    """The masked tokens decode to each assistant reply followed by the template's end of turn."""
    _, tok = tokenizers[name]
    for record in CONVS:
        msgs = messages(record)
        ids, mask = tokenize_conversation(tok, msgs)
        assert ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
        kept = tok.decode([i for i, m in zip(ids, mask) if m])
        assert kept == "".join(m["content"].strip() + end for m in msgs if m["role"] == "assistant")


def test_prepare_writes_tokens_and_mask(tmp_path, tokenizers):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path, tok = tokenizers["llama3"]
    info = data.prepare(cc.write_jsonl(tmp_path / "chat.jsonl", CONVS), path, tmp_path / "out" / "sft")
    ids = IndexedDataset(str(tmp_path / "out" / "sft"))
    mask = IndexedDataset(str(tmp_path / "out" / "sft.mask"))
    expect = [tokenize_conversation(tok, messages(r)) for r in CONVS]
    assert len(ids) == len(mask) == info.documents == len(CONVS)
    assert [(ids[i].tolist(), mask[i].tolist()) for i in range(len(ids))] == [(list(a), list(b)) for a, b in expect]
    assert (info.kind, info.truncated, info.dropped) == (data.CHAT, 0, 0)
    assert info.loss_tokens == sum(sum(m[1:]) for _, m in expect)
    assert info.longest == max(len(i) for i, _ in expect)
    assert data.dataset_info(tmp_path / "out" / "sft") == info


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_overlong_policy_counts(tmp_path, tokenizers, policy):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path, tok = tokenizers["chatml"]
    lengths = [len(tokenize_conversation(tok, messages(r))[0]) for r in CONVS]
    seq = sorted(lengths)[len(lengths) // 2]  # about half are longer than seq + 1
    over = sum(n > seq + 1 for n in lengths)
    info = data.prepare(cc.write_jsonl(tmp_path / "c.jsonl", CONVS), path, tmp_path / "d", seq_len=seq,
                        overlong=policy)
    assert over > 0 and info.truncated + info.dropped == over
    assert info.documents == len(CONVS) - info.dropped and info.longest <= seq + 1
    if policy == "drop":
        assert info.truncated == 0
    ds = IndexedDataset(str(tmp_path / "d"))
    assert max(ds.sequence_lengths) <= seq + 1


def test_bad_lines_name_file_and_line_and_write_nothing(tmp_path, tokenizers, capsys):
    path, _ = tokenizers["chatml"]
    good = json.dumps(CONVS[0])
    cases = {"not json": "{oops", "no shape": json.dumps({"text": "hi"}),
             "bad message": json.dumps({"messages": [{"role": "user"}]}),
             "no assistant": json.dumps({"messages": [{"role": "user", "content": "the cat"}]})}
    for i, line in enumerate(cases.values()):
        src = tmp_path / f"bad{i}.jsonl"
        src.write_text(f"{good}\n\n{good}\n{line}\n")
        with pytest.raises(InputFileError, match=f"bad{i}.jsonl:4: "):
            data.prepare(src, path, tmp_path / "out")
        argv = ["data", "prepare", str(src), "--tokenizer", str(path), "--out", str(tmp_path / "out")]
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert f"bad{i}.jsonl:4: " in err and len(err.strip().splitlines()) == 1
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("bad")], "nothing written"


def test_cli_reports_the_counts(tmp_path, tokenizers, capsys):
    path, _ = tokenizers["chatml"]
    src = cc.write_jsonl(tmp_path / "c.jsonl", CONVS)
    argv = ["data", "prepare", str(src), "--tokenizer", str(path), "--out", str(tmp_path / "d"), "--seq-len", "24"]
    assert main(argv + ["--overlong", "drop"]) == 0
    out = capsys.readouterr().out
    info = data.dataset_info(tmp_path / "d")
    assert f"{info.documents:,} conversations" in out and f"{info.dropped:,} dropped" in out and info.dropped > 0
    assert main(argv) == 1 and "already exists" in capsys.readouterr().err
    assert main(argv + ["--overlong", "cut"]) == 2


def test_runtime_dataset_refuses_what_does_not_fit(tmp_path, tokenizers):
    from toolkit.errors import MissingInputError, SpecError
    from toolkit.runtime.chat_dataset import ChatDataset

    path, _ = tokenizers["chatml"]
    info = data.prepare(cc.write_jsonl(tmp_path / "c.jsonl", CONVS), path, tmp_path / "d")
    with pytest.raises(SpecError, match="--seq-len 16"):
        ChatDataset(tmp_path / "d", 16, 1, False, info.eod)
    ds = ChatDataset(tmp_path / "d", info.longest - 1, 1, False, info.eod)
    assert len(ds) == len(CONVS) and ds[0]["tokens"].shape == (info.longest - 1,)
    (tmp_path / "d.mask.idx").unlink()
    with pytest.raises(MissingInputError, match="no loss mask"):
        ChatDataset(tmp_path / "d", info.longest - 1, 1, False, info.eod)


def test_fill_is_recorded_and_the_plan_counts_it(tmp_path, tokenizers, capsys):
    """`toolkit data prepare --seq-len` records the share of positions a conversation fills
    (packed and not); `toolkit plan` of a spec on that data multiplies its tokens/s by it, as a
    run counts tokens (toolkit.runtime.trainer.step_tokens), and leaves MFU alone."""
    import numpy

    from toolkit.runtime.chat_dataset import ChatDataset, fills

    assert fills(numpy.array([5, 5, 9]), 8) == (16 / 16, 16 / 24)  # 4 + 4 positions share a sequence; 8 alone
    path, _ = tokenizers["chatml"]
    src = cc.write_jsonl(tmp_path / "c.jsonl", CONVS)
    info = data.prepare(src, path, tmp_path / "d", seq_len=64)
    unpacked = ChatDataset(tmp_path / "d", 64, 1, False, info.eod)
    assert info.fill_unpacked == unpacked.fill  # one conversation per sequence: no order dependence
    assert unpacked.fill < info.fill_packed <= 1
    assert main(["data", "prepare", str(src), "--tokenizer", str(path), "--out", str(tmp_path / "e"),
                 "--seq-len", "64"]) == 0
    assert f"fill at seq_len 64: {info.fill_packed:.1%} of the positions" in capsys.readouterr().out
    spec = tmp_path / "s.yaml"
    spec.write_text(f"model: llama-tiny\ncluster: {{nodes: 1, gpus_per_node: 2, gpu: cpu}}\nprecision: fp32\n"
                    f"batch: {{micro: 1, global: 8, seq_len: 64}}\ndata: {{packing: true}}\n"
                    f"train: {{data_path: {tmp_path / 'd'}}}\n")
    plans = {}
    for sets in ([], ["--set", "data.fill=1"], ["--set", "batch.seq_len=32"]):
        assert main(["plan", str(spec), "--json", *sets]) == 0
        plans[len(sets) and sets[1]] = json.loads(capsys.readouterr().out)["time"]
    recorded, full = plans[0], plans["data.fill=1"]
    assert recorded["fill"] == round(info.fill_packed, 4) and full["fill"] == 1
    assert recorded["tokens_per_s"] == pytest.approx(full["tokens_per_s"] * recorded["fill"], rel=1e-12)
    assert recorded["mfu"] == full["mfu"]
    assert plans["batch.seq_len=32"]["fill"] == 1  # measured at 64 only: not assumed at another length
