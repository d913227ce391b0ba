"""Llama-3-8B pretraining (placeholder docstring; layout chosen later)."""
from toolkit.runtime.train import main
from toolkit.spec import TrainingSpec

TINY = "llama-tiny"


def make_spec() -> TrainingSpec:
    return TrainingSpec.from_dict({
        "model": "llama3-8b",
        "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallel": {"tp": 2},
        "zero": {"stage": 1},
        "batch": {"micro": 1, "global": 128, "seq_len": 8192},
        "train": {"steps": 10000, "save_interval": 500},
    })


if __name__ == "__main__":
    raise SystemExit(main(make_spec=make_spec, tiny_model=TINY))
