import pytest

from toolkit.errors import InputFileError, SpecError
from toolkit.spec import TrainingSpec, parse_assignment

from tests.conftest import EXAMPLES, spec_dict


def test_examples_load():
    assert len(EXAMPLES) >= 3
    for path in EXAMPLES:
        TrainingSpec.from_yaml(path)


def test_defaults_and_aliases():
    s = TrainingSpec.from_dict(spec_dict())
    assert s.batch.global_ == 64 and s.to_dict()["batch"]["global"] == 64
    assert s.parallel.sequence_parallel is None and s.parallel.etp is None
    assert TrainingSpec.from_dict(s.to_dict()) == s  # YAML/dict round trip


@pytest.mark.parametrize("key, bad, hint", [
    ("parallel.tpp", 2, "parallel.tpp' (did you mean 'tp'?)"),
    ("zero.offload_optimzer", "cpu", "zero.offload_optimzer' (did you mean 'offload_optimizer'?)"),
    ("batch.seqlen", 10, "batch.seqlen' (did you mean 'seq_len'?)"),
    ("optimiser", {}, "optimiser' (did you mean 'optimizer'?)"),
    ("finetune.methd", "lora", "finetune.methd' (did you mean 'method'?)"),
    ("finetune.lora.rnk", 4, "finetune.lora.rnk' (did you mean 'rank'?)"),
])
def test_unknown_keys_name_the_closest(key, bad, hint):
    with pytest.raises(SpecError, match="unknown key") as e:
        TrainingSpec.from_dict(spec_dict(**{key: bad}))
    assert hint in str(e.value)


def test_lora_targets_are_megatrons_module_names():
    s = TrainingSpec.from_dict(spec_dict(**{"finetune.method": "lora", "finetune.lora.targets": ["linear_qkv"]}))
    assert s.finetune.lora.targets == ("linear_qkv",) and s.finetune.lora.rank == 8
    assert TrainingSpec.from_dict(spec_dict()).finetune.method == "full"
    with pytest.raises(SpecError, match="finetune.lora: unknown target 'q_proj': targets are megatron's module "
                                        "names, Hugging Face's q_proj is in 'linear_qkv'"):
        TrainingSpec.from_dict(spec_dict(**{"finetune.lora.targets": ["q_proj"]}))
    with pytest.raises(SpecError, match=r"unknown target 'linear_qvk' \(did you mean 'linear_qkv'\?\)"):
        TrainingSpec.from_dict(spec_dict(**{"finetune.lora.targets": ["linear_qvk", "linear_proj"]}))
    with pytest.raises(SpecError, match="finetune.method: Input should be 'full' or 'lora'"):
        TrainingSpec.from_dict(spec_dict(**{"finetune.method": "qlora"}))


def test_value_errors_are_located():
    with pytest.raises(SpecError) as e:
        TrainingSpec.from_dict(spec_dict(**{"precision": "bf32", "zero.stage": 4, "parallel.tp": 0}))
    msg = str(e.value)
    assert "precision" in msg and "zero.stage" in msg and "parallel.tp" in msg


def test_yaml_errors(tmp_path):
    with pytest.raises(InputFileError):
        TrainingSpec.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        TrainingSpec.from_yaml(bad)
    # where, as FILE:LINE:COLUMN, what PyYAML found, and where the construct it was in starts (issue 37)
    bad.write_text("model: llama3-8b\nbatch: {micro: 1, global: 8\n  seq_len: 4096}\n")
    with pytest.raises(SpecError) as e:
        TrainingSpec.from_yaml(bad)
    assert str(e.value) == (f"{bad}:3:10: not valid YAML: expected ',' or '}}', but got ':' "
                            "(in a flow mapping that starts at 2:8)")
    bad.write_text("model: llama3-8b\nbatch:\n  micro: 1\n   global: 8\n")
    with pytest.raises(SpecError, match=r"bad.yaml:4:10: not valid YAML: mapping values are not allowed here$"):
        TrainingSpec.from_yaml(bad)
    with pytest.raises(SpecError, match=r"^--set parallel.tp=\[1: the value is not valid YAML at column 3: "
                                        r"expected ',' or '\]', but got '<stream end>'$"):
        parse_assignment("parallel.tp=[1")
    bad.write_text("- a list\n")
    with pytest.raises(SpecError, match="mapping"):
        TrainingSpec.from_yaml(bad)


def test_overrides():
    s = TrainingSpec.from_dict(spec_dict())
    t = s.with_overrides(dict([parse_assignment("parallel.tp=4"), parse_assignment("zero.offload_optimizer=cpu")]))
    assert t.parallel.tp == 4 and t.zero.offload_optimizer == "cpu" and s.parallel.tp == 2
    with pytest.raises(SpecError, match="unknown key 'paralel' \\(did you mean 'parallel'"):
        s.with_overrides({"paralel.tp": 4})
    with pytest.raises(SpecError, match="key=value"):
        parse_assignment("parallel.tp")


def test_atomic_output_is_an_ordinary_folder(tmp_path):
    import os
    import stat

    from toolkit.atomic import atomic_output_dir

    with atomic_output_dir(tmp_path / "out") as d:
        (d / "f").write_text("x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


def test_atomic_output_is_on_the_disk_before_it_is_renamed(tmp_path, monkeypatch):
    """Every file and folder of the output is fsynced while it is still the partial folder,
    and the parent folder after the rename (a spy that calls the real os.fsync)."""
    import os

    from toolkit.atomic import atomic_output_dir

    synced, real = [], os.fsync

    def spy(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), (tmp_path / "out").exists()))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    with atomic_output_dir(tmp_path / "out") as d:
        (d / "sub").mkdir()
        (d / "f").write_text("x")
        (d / "sub" / "g").write_text("y")
        (d / "link").symlink_to("/etc/hostname")
        partial = str(d)
    before = {p for p, renamed in synced if not renamed}
    assert before == {f"{partial}/f", f"{partial}/sub/g", f"{partial}/sub", partial}
    assert synced[-1] == (str(tmp_path), True) and len(synced) == 5


def test_target_hf_leaves_recompute_to_the_trainer():
    """Left out, recompute is megatron's selective, but none with target hf (the HF Trainer has no
    selective recompute: rule hf_selective_recompute refuses it when written); still a default."""
    from toolkit.plan import make_plan

    base = {"model": "llama-tiny", "batch": {"micro": 1, "global": 8, "seq_len": 64},
            "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu"}}
    hf = TrainingSpec.from_dict({**base, "target": "hf"})
    assert hf.recompute == "none" and "recompute" not in hf.given_keys()
    assert hf.with_overrides({"target": "recipes"}).recompute == "selective"
    assert TrainingSpec.from_dict(base).recompute == "selective"
    written = TrainingSpec.from_dict({**base, "target": "hf", "recompute": "selective"})
    assert [f.rule for f in make_plan(written).findings if f.level == "error"] == ["hf_selective_recompute"]
