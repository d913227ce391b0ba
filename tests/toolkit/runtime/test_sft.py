"""Supervised fine-tuning on chat data, on 2 CPU ranks in ONE launch (tests/support/runtime_worker.py):

- the runtime's first loss on chat data (and its tokens/s: conversation positions, no padding)
  is transformers' own loss of the same conversations
  over their assistant tokens only (labels outside the mask ignored), per token over the
  whole global batch, from HF weights: unpacked at dp2, packed at dp2, pp2 and tp2 (sequence
  parallel: the packed mask and positions split over the tp ranks' sequence shards), and Qwen3-MoE's
  (qwen3-moe-tiny, converted) at dp2 and ep2;
- full SFT from the converted weights (packed, fp32, ZeRO-1) trains the data-parallel run's curve at tp2
  and pp2 (4 steps) and Qwen3-MoE's at ep2 (3 steps: later, round-off flips near-tied top-k choices),
  within the round-off bound of tests/recipes/test_recipes.same_curve (each dp2 run again with its
  converted weights nudged by one ulp);
- packed and unpacked training give the same loss and the same gradients (dp-reduced, before
  the update) within fp32 noise, though packing puts the conversations in half as many
  sequences and micro-batches (per-token normalisation across micro-batches and dp ranks);
- the validation loss (train.eval_interval 2, eval_iters 2, 5 steps at lr ~0, so the weights
  stay the HF model's) after steps 2, 4 and 5 is transformers' loss over the validation
  conversations Megatron-LM's semantics pick for evaluations 1, 2, 3 (each the next
  eval_iters global batches), at dp2 and at pp2 with packing (forward-only pipeline).
"""
import json

import pytest
import torch

from toolkit.hf.chat_loss import assistant_loss
from toolkit.runtime import chat_corpus as cc
from toolkit.runtime import data
from toolkit.runtime.tiny_hf import save_tiny_hf

from tests.conftest import SUPPORT
from tests.recipes.test_recipes import ROUND_OFF_MARGIN, launch, max_diff, same_curve, tail
from tests.recipes.test_recipes import metrics as read_metrics

SEQ, SEED = 64, 1234
# fp32 round-off bound for the gradients, relative to each tensor's largest entry: every gradient
# is a sum over the step's ~T = 600 label positions, summed in another order and grouping when
# packed (other micro-batches, other sequences); a sum of T fp32 terms is off by at most about
# T x 2^-24 = 3.6e-5 of the sum of magnitudes, and in practice by ~sqrt(T) x 2^-24 = 1.5e-6. RoPE's
# angles at positions up to 64 rather than from 0 add ~64 x 2^-24 = 4e-6 rad. A masking error (one
# conversation seeing another) changes gradients by far more than 1e-3.
GRAD_RTOL = 1e-4
EVAL_GLOBAL = 4
LOSS_TOL = 1e-5  # fp32 megatron vs transformers on the same weights (as test_correctness)
STEPS, MOE_STEPS = 4, 3
# full SFT from converted weights, packed: name -> (recipe, converted model folder, spec overrides, steps);
# each "... dp2" reference also runs nudged by one ulp ("... dp2 twin"), the round-off bound of same_curve
CURVES = {"packed dp2": ("llama8b", "mg", {}, STEPS),
          "packed tp2": ("llama8b", "mg", {"parallel.tp": 2}, STEPS),
          "packed pp2": ("llama8b", "mg", {"parallel.pp": 2}, STEPS),
          "moe dp2": ("qwen3_30b_a3b", "moe_mg", {}, MOE_STEPS),
          "moe ep2": ("qwen3_30b_a3b", "moe_mg", {"parallel.ep": 2}, MOE_STEPS)}
HF = {"mg": "hf", "moe_mg": "moe_hf"}  # converted folder -> the Hugging Face model it was converted from


def slug(name: str) -> str:
    return name.replace(" ", "_")


def chat_dataset(tmp):
    """Conversations of <= 65 tokens whose count (unpacked global batch) and number of packed
    sequences are both even (2 data-parallel ranks), packing at most half as many sequences."""
    from toolkit.runtime.chat_dataset import ChatDataset

    for n in range(12, 40):
        src = cc.write_jsonl(tmp / "chat.jsonl", cc.conversations(n, seed=7, max_turns=2, max_words=4))
        info = data.prepare(src, tmp / "hf", tmp / "sft", seq_len=SEQ, overlong="drop", overwrite=True)
        packs = len(ChatDataset(tmp / "sft", SEQ, SEED, True, info.eod))
        if info.documents % 2 == 0 and packs % 2 == 0 and 2 * packs <= info.documents:
            return info, packs
    raise AssertionError("no corpus size gives even counts")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from converters import hf_to_megatron

    tmp = tmp_path_factory.mktemp("sft")
    for mg, (hf, name) in {"mg": ("hf", "llama-tiny"), "moe_mg": ("moe_hf", "qwen3-moe-tiny")}.items():
        (tmp / hf).mkdir()
        save_tiny_hf(name, tmp / hf)  # transformers' init, seed 0, and a ChatML tokenizer
        hf_to_megatron(tmp / hf, tmp / mg, tp=1, pp=1, fmt="torch_dist")
    info, packs = chat_dataset(tmp)
    base = {"precision": "fp32", "zero.stage": 0, "batch.micro": 1, "batch.seq_len": SEQ, "train.seed": SEED}
    valid = data.prepare(cc.write_jsonl(tmp / "valid.jsonl", cc.conversations(9, seed=11, max_turns=2, max_words=4)),
                         tmp / "hf", tmp / "valid", seq_len=SEQ, overlong="drop")
    assert valid.documents == 9
    evals = {"train.eval_interval": 2, "train.eval_iters": 2, "train.valid_data_path": str(tmp / "valid"),
             "optimizer.lr": 1e-12, "optimizer.min_lr": 1e-12, "batch.global": EVAL_GLOBAL}
    runs = {"unpacked": {"batch.global": info.documents},
            "packed": {"batch.global": packs, "data.packing": True}}
    items = [{"name": name, "recipe": "llama8b", "sets": {**base, **sets}, "load": str(tmp / "mg"),
              "data": str(tmp / "sft"), "first_step": True, "dump_grads": True, "out": str(tmp / slug(name))}
             for name, sets in runs.items()]
    packed = {**base, "batch.global": packs, "data.packing": True, "zero.stage": 1}
    curves = {**CURVES, **{f"{n} twin": CURVES[n] for n in CURVES if n.endswith("dp2")}}
    items += [{"name": name, "recipe": recipe, "sets": {**packed, **sets}, "load": str(tmp / mg), "steps": steps,
               "data": str(tmp / "sft"), "nudge": name.endswith("twin"), "out": str(tmp / slug(name))}
              for name, (recipe, mg, sets, steps) in curves.items()]
    items += [{"name": name, "recipe": "llama8b", "sets": {**base, **evals, **sets}, "load": str(tmp / "mg"),
               "data": str(tmp / "sft"), "steps": 5, "out": str(tmp / slug(name))}
              for name, sets in (("eval dp2", {}), ("eval pp2 packed", {"parallel.pp": 2, "zero.stage": 1,
                                                                            "data.packing": True}))]
    (tmp / "runs.json").write_text(json.dumps(items))
    r = launch(str(SUPPORT / "runtime_worker.py"), str(tmp / "runs.json"), launcher="torchrun", timeout=1200)
    assert r.returncode == 0, tail(r)
    return tmp, info, packs


def first_step(tmp, name: str) -> dict:
    """The run's first step: a first-step run's record (worker.json), or a curve run's first metrics line."""
    if name in CURVES:
        return read_metrics(tmp / slug(name))[0]
    return json.loads((tmp / slug(name) / "worker.json").read_text())["first_step"]


def transformers_loss(tmp, prefix: str = "sft", which: list[int] | None = None, hf: str = "hf") -> tuple[float, int]:
    """transformers' model (tmp/hf) on every conversation alone (`which`: these, default all):
    cross-entropy summed over the assistant labels, divided by their count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp / hf), dtype=torch.float32)
    return assistant_loss(model, tmp / prefix, range(data.dataset_info(tmp / prefix).documents) if which is None
                          else which)


@pytest.mark.multirank
def test_first_loss_is_transformers_loss_on_assistant_tokens(results):
    tmp, info, packs = results
    wants = {hf: transformers_loss(tmp, hf=hf) for hf in HF.values()}
    assert {count for _, count in wants.values()} == {info.loss_tokens}
    for name in ("unpacked", "packed", *CURVES):
        want, count = wants[HF[CURVES[name][1]] if name in CURVES else "hf"]
        step = first_step(tmp, name)
        got = step["loss"]
        # tokens/s counts the positions holding a conversation (the whole set, one step), not the padding
        assert round(step["tokens_per_s"] * step["step_time_s"]) == info.tokens - info.documents, name
        print(f"{name}: first loss {got:.7f}, transformers over {count} assistant tokens {want:.7f}")
        assert abs(got - want) < LOSS_TOL, name
    print(f"{info.documents} conversations in {packs} packed sequences of {SEQ}")


@pytest.mark.multirank
def test_packed_and_unpacked_gradients_agree(results):
    tmp, info, packs = results
    a, b = torch.load(tmp / "unpacked" / "grads.pt"), torch.load(tmp / "packed" / "grads.pt")
    assert a.keys() == b.keys() and len(a) > 10
    worst = max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a)
    print(f"packed ({packs} sequences) vs unpacked ({info.documents}): gradients' max |diff| / max |g| = "
          f"{worst:.2e} (bound {GRAD_RTOL})")
    assert worst < GRAD_RTOL
    assert all(a[k].abs().max() > 0 for k in a)


@pytest.mark.multirank
@pytest.mark.parametrize("name,packing", [("eval dp2", False), ("eval pp2 packed", True)])
def test_validation_loss_follows_megatron_lm(results, name, packing):
    from toolkit.runtime.chat_dataset import ChatDataset

    tmp, _, _ = results
    rows = [json.loads(line) for line in (tmp / slug(name) / "metrics.jsonl").read_text().splitlines()]
    got = {r["step"]: r["valid_loss"] for r in rows if "valid_loss" in r}
    assert sorted(got) == [2, 4, 5] and len(rows) == 5
    info = data.dataset_info(tmp / "valid")
    ds = ChatDataset(tmp / "valid", SEQ, SEED, packing, info.eod)
    per_eval = 2 * EVAL_GLOBAL  # eval_iters x global samples
    for k, step in enumerate(sorted(got)):
        samples = [ds.samples[i % len(ds)] for i in range(k * per_eval, (k + 1) * per_eval)]
        want, count = transformers_loss(tmp, "valid", [c for s in samples for c in s])
        print(f"{name}: validation loss after step {step} {got[step]:.7f}, transformers over {count} "
              f"assistant tokens of validation samples [{k * per_eval}, {(k + 1) * per_eval}) {want:.7f}")
        assert abs(got[step] - want) < LOSS_TOL, step


@pytest.mark.multirank
@pytest.mark.parametrize("name", [n for n in CURVES if not n.endswith("dp2")])
def test_full_sft_layout_gives_the_data_parallel_curve(results, name):
    """Full SFT from converted HF weights on chat data (assistant mask, packed) at tp2 (sequence
    parallel), pp2 and, for Qwen3-MoE, ep2: the curve of dp2 on the same samples from the same weights."""
    tmp, _, _ = results
    ref = name.split()[0] + " dp2"
    run, dp, twin = (read_metrics(tmp / slug(n)) for n in (name, ref, f"{ref} twin"))
    assert len(run) == CURVES[name][3] and run[-1]["loss"] < run[0]["loss"] - 0.05, "full SFT trains"
    d, off = max_diff(run, dp), same_curve(run, dp, twin)
    last = ROUND_OFF_MARGIN * max(max_diff(dp, twin), float(torch.finfo(torch.float32).eps) * dp[-1]["loss"])
    print(f"full SFT {name}: loss {run[0]['loss']:.4f} -> {run[-1]['loss']:.4f}, max |diff| vs {ref} {d:.1e} "
          f"({off:.2f} of the round-off bound; at the last step the bound is {last:.1e})")
    assert off < 1
