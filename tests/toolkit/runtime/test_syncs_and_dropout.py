"""The runtime on what CPU runs hide (issue 38, items 8 and 9), on 2 CPU ranks in ONE launch
(tests/support/runtime_worker.py runs the list below in turn):

- device synchronisations per step, counted as calls (tests/support/host_syncs.py: on CPU they return
  at once, on CUDA each waits for the GPU): none, at any number of micro-batches, pp = 1 and 2
  (DeepSpeed's throughput timer, synchronised by default, called synchronize at every forward
  and every engine.step()); host reads of a tensor per step do not grow with the micro-batches;
  the causal mask is allocated once per run, not at every forward;
- dropout streams as Megatron-LM seeds them (``_set_random_seed`` then megatron-core's
  ``model_parallel_cuda_manual_seed``): pipeline stages seed seed + 100 x pp rank; attention-
  probability masks differ across tensor-parallel ranks and are the draws of 'model-parallel-rng'
  (seed + 2718 + tp rank); hidden-state (and embedding) masks agree across tp ranks without
  sequence parallelism and differ with it (megatron forks the whole block then);
- with attention dropout from the model's HF config: selective and full recompute redraw the
  forward's masks (the first step's loss and gradient norm equal the run without recompute),
  the runtime trains (the loss falls), and a resume continues the same dropout streams (steps
  after the checkpoint equal the uninterrupted run's).
"""
import json

import pytest
import torch

from tests.conftest import SUPPORT
from tests.recipes.test_recipes import launch, metrics, tail

SEQ = 64  # the tiny flavour's sequence length
SYNC_RUNS = {  # name -> spec overrides (llama8b recipe, tiny flavour, 2 ranks); 4 steps each
    "dp2 4 micro-batches": {"batch.global": 8},
    "dp2 8 micro-batches": {"batch.global": 16},
    "pp2 8 micro-batches": {"parallel.pp": 2, "batch.global": 8},
}
PROBES = {"tp2": {"parallel.tp": 2, "parallel.sequence_parallel": False},
          "tp2 sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
          "pp2": {"parallel.pp": 2}}
RECOMPUTE = {f"tp2{' sp' if sp else ''} {r}": {"parallel.tp": 2, "parallel.sequence_parallel": sp, "recompute": r}
             for sp in (False, True) for r in ("none", "selective", "full")}
DROPOUT = 0.1
SEED = 1234  # the recipes' train.seed


def slug(name: str) -> str:
    return name.replace(" ", "_")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from toolkit.models import named_models

    tmp = tmp_path_factory.mktemp("syncs_dropout")
    model = tmp / "llama-dropout"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**named_models()["llama-tiny"]["config"],
                                                   "attention_dropout": DROPOUT}))
    base = {"zero.stage": 1, "recompute": "none", "batch.micro": 1}
    runs = [{"name": n, "recipe": "llama8b", "sets": {**base, **over}, "steps": 4, "count_syncs": True,
             "out": str(tmp / slug(n))} for n, over in SYNC_RUNS.items()]
    runs += [{"name": f"probe {n}", "recipe": "llama8b", "sets": {**base, **over}, "dropout_probe": True,
              "forward": "tp" in n, "out": str(tmp / slug(f"probe {n}"))} for n, over in PROBES.items()]
    runs += [{"name": n, "recipe": "llama8b", "sets": {**base, "model": str(model), **over}, "first_step": True,
              "out": str(tmp / slug(n))} for n, over in RECOMPUTE.items()]
    trained = {**base, "model": str(model), "parallel.tp": 2, "train.save_interval": 5}
    runs.append({"name": "dropout train", "recipe": "llama8b", "sets": trained, "steps": 10, "out": str(tmp / "train")})
    runs.append({"name": "dropout resume", "recipe": "llama8b", "sets": trained, "steps": 10,
                 "out": str(tmp / "resume"), "load": str(tmp / "train" / "checkpoints" / "global_step5")})
    (tmp / "runs.json").write_text(json.dumps(runs))
    r = launch(str(SUPPORT / "runtime_worker.py"), str(tmp / "runs.json"), launcher="torchrun", timeout=1200)
    assert r.returncode == 0, tail(r)
    return tmp


def facts(folder) -> dict:
    return json.loads((folder / "worker.json").read_text())


# ------------------------------------------------------------------------------ item 8
@pytest.mark.multirank
def test_no_device_synchronisation_in_a_step(results):
    """DeepSpeed's throughput timer synchronised at every forward and engine.step() once its
    third step began: 2 per micro-batch at pp = 1, micro-batches + 1 at pp = 2 (DeepSpeed's
    ThroughputTimer, start_step 2). The runtime turns it off: none at any step."""
    for name in SYNC_RUNS:
        steps = facts(results / slug(name))["syncs"]
        print(f"{name}: synchronize per step {[s['synchronize'] for s in steps]}, host reads per step "
              f"{[s['reads'] for s in steps]}")
        assert len(steps) == 4 and all(s["synchronize"] == 0 for s in steps), (name, steps)


@pytest.mark.multirank
def test_host_reads_do_not_grow_with_micro_batches(results):
    """What the step reads on the host (the loss and gradient norm the runtime reports,
    DeepSpeed's overflow and norm checks) is per step, not per micro-batch."""
    four, eight = ([s["reads"] for s in facts(results / slug(n))["syncs"]]
                   for n in ("dp2 4 micro-batches", "dp2 8 micro-batches"))
    assert four[1:] == eight[1:] and len(set(four[1:])) == 1, (four, eight)


@pytest.mark.multirank
def test_causal_mask_is_allocated_once(results):
    """The s x s bool mask megatron's local attention is given: built in the first step (torch.ones,
    then triu: 2 s^2 bytes, s^2 kept), never again (it was built at every forward)."""
    for name in SYNC_RUNS:
        masks = [s["square_bool_bytes"] for s in facts(results / slug(name))["syncs"]]
        print(f"{name}: s x s bool bytes allocated per step {masks}")
        assert masks == [2 * SEQ * SEQ, 0, 0, 0], (name, masks)


# ------------------------------------------------------------------------------ item 9
def probe(results, name: str) -> list[dict]:
    return facts(results / slug(f"probe {name}"))["ranks"]


def bits(mask: dict) -> torch.Tensor:
    import numpy as np

    n = int(np.prod(mask["shape"]))
    packed = np.frombuffer(bytes.fromhex(mask["bits"]), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(packed)[:n].astype(bool)).reshape(mask["shape"])


def megatron_draw(seed: int, shape: list[int]) -> torch.Tensor:
    """The keep-mask a CPU dropout of p = 0.5 draws first from a generator seeded with `seed`."""
    return torch.empty(shape).bernoulli_(0.5, generator=torch.Generator().manual_seed(seed)).bool()


@pytest.mark.multirank
def test_pipeline_stages_and_tp_ranks_get_megatrons_seeds(results):
    for name in PROBES:
        for r in probe(results, name):
            seed = SEED + 100 * r["pp_rank"]
            model_parallel = torch.rand(4, generator=torch.Generator().manual_seed(seed + 2718 + r["tp_rank"]))
            assert r["initial_seed"] == seed, (name, r["rank"])
            assert r["model_parallel_draws"] == model_parallel.tolist(), (name, r["rank"])
    assert [r["initial_seed"] for r in probe(results, "pp2")] == [SEED, SEED + 100]


def masks_by_tp_rank(results, name: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    a, b = sorted(probe(results, name), key=lambda r: r["tp_rank"])
    return [bits(m) for m in a["masks"]], [bits(m) for m in b["masks"]]


@pytest.mark.multirank
def test_attention_masks_differ_across_tp_ranks(results):
    """Each tp rank holds other heads: megatron draws their masks from 'model-parallel-rng' (its
    own fork without sequence parallelism, the block's fork with it), so they differ; the first
    one is that stream's first draw."""
    for name in ("tp2", "tp2 sp"):
        ranks = masks_by_tp_rank(results, name)
        attention = [[m for m in masks if m.dim() == 4] for masks in ranks]
        assert len(attention[0]) == 4  # one per layer (llama-tiny: 4 layers)
        assert all(not torch.equal(a, b) for a, b in zip(*attention)), name
        if name == "tp2":
            for tp_rank, masks in enumerate(attention):
                assert torch.equal(masks[0], megatron_draw(SEED + 2718 + tp_rank, list(masks[0].shape)))


@pytest.mark.multirank
def test_hidden_masks_agree_across_tp_ranks_unless_sequence_parallel(results):
    """Without sequence parallelism every tp rank holds the whole hidden state: embedding and
    residual dropout draw from the default stream, the same mask on every tp rank (else the
    replicas would part). With it each holds s/tp tokens and megatron forks 'model-parallel-rng'
    for the embedding and the whole block: different masks, the first being that stream's first draw."""
    plain = [[m for m in masks if m.dim() == 3] for masks in masks_by_tp_rank(results, "tp2")]
    assert len(plain[0]) == 1 + 2 * 4  # embedding, then after attention and after the MLP in each layer
    assert all(torch.equal(a, b) for a, b in zip(*plain))
    sp = [[m for m in masks if m.dim() == 3] for masks in masks_by_tp_rank(results, "tp2 sp")]
    assert sp[0][0].shape[0] == SEQ // 2
    assert all(not torch.equal(a, b) for a, b in zip(*sp))
    for tp_rank, masks in enumerate(sp):
        assert torch.equal(masks[0], megatron_draw(SEED + 2718 + tp_rank, list(masks[0].shape)))


@pytest.mark.multirank
def test_recompute_redraws_the_forward_masks(results):
    for sp in ("", " sp"):
        ref = facts(results / slug(f"tp2{sp} none"))["first_step"]
        for r in ("selective", "full"):
            got = facts(results / slug(f"tp2{sp} {r}"))
            print(f"attention dropout {DROPOUT}, tp2{sp} recompute {r}: first loss {got['first_step']['loss']:.7f} "
                  f"(none: {ref['loss']:.7f}), grad norm {got['first_step']['grad_norm']:.7f} "
                  f"(none: {ref['grad_norm']:.7f}), {got['recomputed']} checkpointed calls")
            assert got["recomputed"] > 0
            assert got["first_step"]["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=0)
            assert got["first_step"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6, abs=0)


@pytest.mark.multirank
def test_trains_with_dropout_and_resumes_its_streams(results):
    run = metrics(results / "train")
    losses = [m["loss"] for m in run]
    print(f"attention dropout {DROPOUT}, tp2: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps")
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5
    resumed = metrics(results / "resume")
    assert [m["step"] for m in resumed] == list(range(6, 11))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in run[5:]]
