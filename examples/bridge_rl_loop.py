"""An RL weight-sync loop in miniature: train a few steps in the toolkit's runtime (megatron-core
GPTModel under DeepSpeed, ZeRO-3 by default), then stream the trained weights under Hugging Face
names (toolkit.bridge.export_hf) into a transformers model living in ANOTHER process, as an
inference engine (vLLM, SGLang) would receive them, and compare its logits with the training
model's.

    torchrun --nproc_per_node 2 examples/bridge_rl_loop.py            # ZeRO-3, 2 CPU ranks
    torchrun --nproc_per_node 2 examples/bridge_rl_loop.py --set zero.stage=1 --steps 5

Rank 0 starts the "inference" process (torch.multiprocessing, spawn) and sends it each
(hf_name, tensor) as export_hf yields it (one full tensor in flight); every rank runs the
export (it is collective: ZeRO-3 gathers each parameter for its tensor only). Prints one line:
the loss of each step and the largest logit difference, and exits 1 if it exceeds --tolerance.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

SEQ, BATCH = 16, 2


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def inference_engine(config: dict, inbox, outbox) -> None:
    """The other process: a transformers model filled tensor by tensor from the inbox, then its
    logits on the fixed tokens go back."""
    from transformers import AutoModelForCausalLM

    from toolkit.models.registry import hf_config_object

    model = AutoModelForCausalLM.from_config(hf_config_object(config), dtype=torch.float32).eval()
    own, received = model.state_dict(), set()
    while (item := inbox.get()) is not None:
        name, tensor = item
        with torch.no_grad():
            own[name].copy_(tensor)
        received.add(name)
    missing = sorted(set(own) - received - ({"lm_head.weight"} if config.get("tie_word_embeddings") else set()))
    with torch.no_grad():
        outbox.put((missing, model(input_ids=tokens(config["vocab_size"])).logits.float().numpy()))  # by value


def spec(world: int, sets: list[str]):
    from toolkit.spec import TrainingSpec, parse_assignment

    s = TrainingSpec.from_dict({
        "model": "llama-tiny", "cluster": {"nodes": 1, "gpus_per_node": world, "gpu": "cpu"},
        "parallel": {"tp": 1}, "zero": {"stage": 3}, "precision": "fp32", "recompute": "none",
        "batch": {"micro": 2, "global": 2 * world, "seq_len": 64},
        "optimizer": {"impl": "torch", "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 0},
        "train": {"steps": 1000, "log_interval": 1, "save_interval": 1000}})
    return s.with_overrides(dict(parse_assignment(a) for a in sets))


def training_logits(sess, vocab: int) -> torch.Tensor | None:
    """The trained model's logits on the fixed tokens (tp = pp = 1; collective under ZeRO-3)."""
    from toolkit.mcore import cpu_compat

    model = sess.chunks[0].eval()
    with torch.no_grad():
        out = model(tokens(vocab), torch.arange(SEQ).expand(BATCH, SEQ), cpu_compat.causal_mask(SEQ))
    return out[..., :vocab].float()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec override")
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.add_argument("--out", type=Path, default=Path("build/bridge_rl_loop"), help="the run's folder (its data)")
    args = p.parse_args(argv)

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from toolkit import bridge
    from toolkit.mcore.distributed import init_process_group
    from toolkit.models import hf_config_dict
    from toolkit.plan import make_plan
    from toolkit.runtime import trainer

    _, world = init_process_group()
    plan = make_plan(spec(world, args.set)).require_valid()
    sess = trainer.setup(plan, trainer.RunOptions(out=args.out, data=trainer.BUILTIN, overwrite=True))
    losses = [trainer.run_step(sess, step).loss for step in range(args.steps)]
    trained = training_logits(sess, plan.shape.vocab_size)
    config = hf_config_dict(plan.shape)
    engine = None
    if dist.get_rank() == 0:
        ctx = mp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        engine = ctx.Process(target=inference_engine, args=(config, inbox, outbox))
        engine.start()
    for name, tensor in bridge.export_hf(sess.engine, plan.shape, dst=0):
        if engine is not None:
            inbox.put((name, tensor))
    status = 0
    if engine is not None:
        inbox.put(None)
        missing, logits = outbox.get()
        engine.join()
        diff = float((torch.from_numpy(logits) - trained).abs().max())
        status = int(bool(missing) or not diff <= args.tolerance)
        print(f"zero={plan.spec.zero.stage} losses={[round(x, 4) for x in losses]} "
              f"max|dlogit| training vs transformers = {diff:.2e}" + (f" missing={missing}" if missing else ""))
    trainer.close(sess)
    codes = [status]
    dist.broadcast_object_list(codes, src=0)
    return codes[0]


if __name__ == "__main__":
    code = main(sys.argv[1:])
    from toolkit.mcore.distributed import destroy

    destroy()  # every rank is done: a rank leaving with its gloo groups alive can abort in torch's teardown
    sys.exit(code)
