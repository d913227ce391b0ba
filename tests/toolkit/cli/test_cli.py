"""The command line: exit codes, JSON, tables, writing configs."""
import json
import subprocess
import sys

import torch

from toolkit.cli import main

from tests.conftest import ROOT, subprocess_env

SEED = str(ROOT / "examples/llama70b_1024gpu.yaml")


def test_plan_table_and_json(capsys):
    assert main(["plan", SEED]) == 0
    text = capsys.readouterr().out
    assert "tp=8 pp=8" in text and "dp=16" in text and "global 2048 = micro 1 x accumulation 128 x dp 16" in text
    assert main(["plan", SEED, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["valid"] and d["fits"] and d["layout"]["dp"] == 16


def test_plan_table_names_the_routing_it_estimates(capsys):
    moe = ["--set", "model=mixtral-8x7b", "--set", "parallel.ep=8", "--set", "parallel.tp=1", "--set", "parallel.pp=1",
           "--set", "parallel.vpp=1", "--set", "parallel.sequence_parallel=false", "--set", "zero.stage=2"]
    assert main(["plan", SEED, *moe]) == 0
    text = capsys.readouterr().out
    assert "8 x top-2, alltoall dispatcher, dropless" in text and "balanced routing" in text
    assert main(["plan", SEED, *moe, "--set", "moe.capacity_factor=1.25", "--set", "moe.pad_to_capacity=true"]) == 0
    assert "capacity 1.25 (padded to it)" in capsys.readouterr().out
    assert main(["plan", SEED, *moe, "--set", "moe.capacity_factor=0.5"]) == 0
    text = capsys.readouterr().out
    assert "capacity 0.5 (dropped above it)" in text and "0.50 x its balanced share" in text
    assert main(["plan", SEED]) == 0
    assert "experts" not in capsys.readouterr().out  # a dense model has no row


def test_invalid_plan_exit_2_all_errors(capsys):
    code = main(["plan", SEED, "--json", "--set", "parallel.tp=3", "--set", "zero.stage=2", "--set", "batch.global=7"])
    assert code == 2
    d = json.loads(capsys.readouterr().out)
    assert not d["valid"] and len(d["errors"]) >= 4
    assert any("tp=3 does not divide num_attention_heads=64" in e for e in d["errors"])


def test_bad_spec_exit_2_and_missing_file_exit_3(tmp_path, capsys):
    bad = tmp_path / "s.yaml"
    bad.write_text(open(SEED).read().replace("recompute:", "recomptue:"))
    assert main(["plan", str(bad)]) == 2
    assert "unknown key 'recomptue' (did you mean 'recompute'?)" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "none.yaml")]) == 3


def test_config_writes_and_refuses(tmp_path, capsys):
    out = tmp_path / "cfg"
    assert main(["config", SEED, "--out", str(out)]) == 0
    assert (out / "ds_config.json").is_file()
    assert main(["config", SEED, "--out", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["config", SEED, "--out", str(tmp_path / "bad"), "--set", "parallel.pp=3"]) == 2
    assert not (tmp_path / "bad").exists()


def test_version_names_the_libraries(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("ds-megatron-toolkit ") and f"torch {version('torch')}" in line
    assert f"deepspeed {version('deepspeed')}" in line and f"megatron-core {version('megatron-core')}" in line


def test_module_and_console_script():
    env = subprocess_env()
    r = subprocess.run([sys.executable, "-m", "toolkit", "plan", SEED, "--json"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["batch"]["grad_accum"] == 128
    r = subprocess.run([sys.executable, "-m", "toolkit", "models"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and "8,030,261,248" in r.stdout


def test_config_checks_the_output_before_planning_and_names_files_relatively(tmp_path, monkeypatch, capsys):
    import yaml

    monkeypatch.chdir(tmp_path)
    assert main(["config", SEED, "--out", "cfg"]) == 0
    acc = yaml.safe_load((tmp_path / "cfg" / "accelerate_config.yaml").read_text())
    assert acc["deepspeed_config"]["deepspeed_config_file"] == "cfg/ds_config_hf.json"
    assert "/" + tmp_path.name + "/" not in "".join(p.read_text() for p in (tmp_path / "cfg").iterdir())
    capsys.readouterr()
    # an existing folder is refused first: no plan is made (the invalid layout is never reported)
    assert main(["config", SEED, "--out", "cfg", "--set", "parallel.tp=3"]) == 1
    captured = capsys.readouterr()
    assert "already exists" in captured.err and "tp=3" not in captured.out + captured.err


def test_launch_scripts_check_the_data_before_the_launcher(tmp_path, capsys):
    """A spec without train.data_path: `toolkit config` warns, and the written launch scripts
    stop in one line before torchrun starts a rank (issue 37: 13 s, then torchrun's traceback);
    a data_path whose files do not exist: exit 3, one line. Nothing here starts a rank."""
    import os

    import yaml

    spec = {"model": "llama-tiny", "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu"}, "precision": "fp32",
            "batch": {"micro": 1, "global": 2, "seq_len": 32}, "attention": {"backend": "unfused"}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert main(["config", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "cfg")]) == 0
    assert capsys.readouterr().err.startswith("warning: train.data_path is not set: the launch scripts will stop")
    env = {**subprocess_env(), "PATH": os.pathsep.join([str(ROOT / ".venv/bin"), os.path.dirname(sys.executable),
                                                        os.environ["PATH"]])}
    for data, code, message in ((None, 2, "error: no training data: pass --data PREFIX"),
                                ("/nowhere/corpus", 3, "error: dataset '/nowhere/corpus.bin' does not exist")):
        out = tmp_path / f"cfg{code}"
        sets = ["--set", f"train.data_path={data}"] if data else []
        assert main(["config", str(tmp_path / "spec.yaml"), "--out", str(out), *sets]) == 0
        assert ("warning" in capsys.readouterr().err) == (data is None)
        for script in ("launch_torchrun.sh", "launch_deepspeed.sh"):
            r = subprocess.run(["bash", str(out / script)], capture_output=True, text=True, env=env, timeout=300)
            assert r.returncode == code and len(r.stderr.splitlines()) == 1, r.stderr[-2000:]
            assert r.stderr.startswith(message) and r.stdout == "", r.stderr


def test_tiny_model_is_a_folder_transformers_loads_and_bad_names_are_one_line(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert main(["tiny-model", "llama-tiny", str(out), "--chat-template", "llama3"]) == 0
    model, tok = AutoModelForCausalLM.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True)["input_ids"]
    assert "<|start_header_id|>assistant<|end_header_id|>" in tok.decode(ids)
    assert model(input_ids=torch.tensor([ids])).logits.shape[-1] == model.config.vocab_size
    capsys.readouterr()
    assert main(["tiny-model", "llama-tiny", str(out)]) == 1  # never replaced unasked
    assert "already exists (pass --overwrite" in capsys.readouterr().err
    assert main(["tiny-model", "lama-tiny", str(tmp_path / "a")]) == 2
    assert "'lama-tiny' is not a tiny model (did you mean 'llama-tiny'?)" in capsys.readouterr().err
    assert main(["tiny-model", "llama3-8b", str(tmp_path / "b")]) == 2  # a real model's weights are the hub's
    assert main(["tiny-model", "llama-tiny", str(tmp_path / "c"), "--chat-template", "chatm"]) == 2
    assert "unknown chat template 'chatm' (did you mean 'chatml'?)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing half-written
