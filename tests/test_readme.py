"""README.md, read top to bottom, runs as written on a fresh clone (issue 19).

Every ```sh block is run in order, line by line, in a fresh copy of the repository (the
files `git ls-files` knows, nothing built), with this environment's `.venv/bin` first on
PATH (the README's `source .venv/bin/activate`) and the copy first on PYTHONPATH (what its
editable install would give). A line whose comment starts with `exit N` must exit N;
every other line must exit 0. Not run, each by an explicit marker: a block preceded by
`<!-- readme-test: not run: REASON -->` (set-up: it builds this very environment) and lines
marked `[cluster]` (a GPU cluster) or `[benchmark]` (minutes of measurement); for those
lines the test checks that the files they name exist. The one change to the commands: each
`deepspeed` / `accelerate launch` gets a free port, as other launches share this machine.
Where a command is the only run of its kind in the suite, EXPECT also checks its output
(the HF example under `accelerate launch`: the plan it reports and a falling loss; the LoRA adapter
that peft loads lowers the base's loss; the recipe
run stopped by --exit-interval and resumed: what each says, the data the spec records, and a
learning rate that keeps falling across the resume, on one 20-step schedule).
Output is held to a budget (issue 37): a launch prints at most LAUNCH_STDERR_LINES lines on
stderr (the libraries' chatter is behind --verbose), no rank prints DeepSpeed's shm-op line
or its CPU auto-detection (only the launcher's own two processes may), and every command
that writes (it carries --overwrite) runs a second time in the same clone, as a reader
re-running the README does; the launches among them were re-run by hand (minutes each).
The ```yaml spec must be a valid spec, the ```python block must compile against toolkit.hf,
and every relative link of README.md and docs/*.md must resolve.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, free_port

README = ROOT / "README.md"
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<note>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
MARKERS = {"cluster": "needs a GPU cluster", "benchmark": "minutes of measurement"}
LAUNCHERS = ("deepspeed ", "accelerate launch ")
LAUNCH_STDERR_LINES = 0  # each of the 5 launches, after issue 37; before: 16, 4, 4, 12 and 3,020 (accelerate)
RANK_CHATTER = {"shm_comm_op built successfully": 0, "Setting accelerator to CPU": 2}  # line -> most allowed
PATHLIKE = re.compile(r"^[\w.-]+(/[\w.-]+)*\.(py|yaml|yml|json|txt|sh)$")


@dataclass(frozen=True)
class Command:
    text: str
    exit: int  # expected exit code
    marker: str | None  # why it is not run, or None


def falling_loss(out: str) -> bool:
    m = re.search(r"loss ([\d.]+) -> ([\d.]+) in (\d+) steps", out)
    return bool(m) and int(m[3]) >= 8 and float(m[2]) < float(m[1]) - 0.5


def one_schedule(metrics: Path, steps: int = 20) -> bool:
    """Steps 1..steps logged once each, the lr falling at every step (cosine, no warm-up): the
    resumed half continues the first half's schedule instead of restarting a longer one."""
    import json

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    lrs = [r["lr"] for r in rows]
    return [r["step"] for r in rows] == list(range(1, steps + 1)) and all(a > b for a, b in zip(lrs, lrs[1:]))


def adapter_learned(out: str) -> bool:
    """transformers + peft's loader: the exported LoRA adapter lowers the base's loss on the data
    it was trained on (20 steps: 6.27 -> 5.95 when written)."""
    m = re.search(r"base ([\d.]+), with the adapter ([\d.]+)", out)
    return bool(m) and float(m[2]) < float(m[1]) - 0.1


def lora_run_starts_at_transformers_loss(clone: Path) -> bool:
    """The LoRA run's first loss is transformers' own on the first global batch's conversations
    (the adapters start at zero: the converted base at ep2), and it falls with only the adapters
    training."""
    import json

    from toolkit.runtime import data
    from toolkit.runtime.chat_dataset import ChatDataset
    from toolkit.runtime.recipe import TINY_BATCH

    from tests.recipes.test_llama8b_sft import transformers_loss

    losses = [json.loads(line)["loss"] for line in (clone / "runs/lora/metrics.jsonl").read_text().splitlines()]
    prefix = clone / "data/chat"
    ds = ChatDataset(prefix, TINY_BATCH["seq_len"], 1234, True, data.dataset_info(prefix).eod)
    want = transformers_loss(clone / "build/qwen3-moe-tiny", ds.samples[:TINY_BATCH["global"]], prefix)
    print(f"LoRA run: first loss {losses[0]:.6f} (transformers {want:.6f}), last 3 {losses[-3:]}")
    return abs(losses[0] - want) < 1e-5 and sum(losses[-3:]) / 3 < losses[0] - 0.2


RECIPE_A = "deepspeed --num_gpus 2 recipes/llama8b.py --flavor tiny --data data/corpus --out runs/a"
# command prefix -> checks of (its stdout, the clone) beyond the exit code
EXPECT = {
    f"{RECIPE_A} --steps 20 --exit-interval 10": [
        lambda out, _: "stopped after step 10 of 20 (--exit-interval 10); continue with --load runs/a --steps 20" in out,
        lambda _, clone: yaml.safe_load((clone / "runs/a/spec.yaml").read_text())["train"]["data_path"] == "data/corpus"],
    f"{RECIPE_A} --load runs/a --steps 20": [
        lambda out, _: "resumed 'runs/a/checkpoints/global_step10' at step 10 (80 samples consumed); learning rate: "
                       "the checkpoint's schedule, the same as this run's (cosine decay over 20 steps (160 samples))"
                       in out.splitlines(),
        lambda _, clone: one_schedule(clone / "runs/a/metrics.jsonl")],
    "toolkit status runs/a": [
        lambda out, _: out.splitlines()[0] == "run: runs/a: finished" and "step: 20/20 (100.0%)" in out
        and out.splitlines()[-1] == "checkpoint: runs/a/checkpoints/global_step20"],
    "deepspeed --num_gpus 2 recipes/qwen3_30b_a3b_lora.py": [
        lambda _, clone: lora_run_starts_at_transformers_loss(clone)],
    "python examples/peft_adapter_loss.py build/qwen3-moe-tiny build/lora-adapter data/chat": [
        lambda out, _: adapter_learned(out)],
    "accelerate launch --config_file build/hf_cfg/accelerate_config.yaml examples/hf_trainer_finetune.py": [
        lambda out, _: "plan: llama-tiny on 2 x cpu" in out and "ZeRO-3" in out,
        lambda out, _: falling_loss(out),
        lambda _, clone: (clone / "build/hf_trainer_finetune/model/model.safetensors").is_file()],
}


def blocks(lang: str) -> list[tuple[str | None, str]]:
    """(note, body) of every ```lang block, in order."""
    return [(m["note"], m["body"]) for m in BLOCK.finditer(README.read_text()) if m["lang"] == lang]


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment): the comment starts at a `#` after whitespace, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def commands(body: str) -> list[Command]:
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        text, comment = split_comment(line)
        if not text:
            continue
        tags = re.findall(r"\[(\w+)\]", comment)
        assert set(tags) <= set(MARKERS), f"unknown marker {tags} in README line: {line}"
        expected = re.match(r"exit (\d+)", comment)
        out.append(Command(text, int(expected[1]) if expected else 0, tags[0] if tags else None))
    return out


def readme_commands() -> list[Command]:
    found = []
    for note, body in blocks("sh"):
        if note is not None:
            assert note.startswith("not run: "), note
            continue
        found += commands(body)
    return found


def fresh_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def is_launch(text: str) -> bool:
    return text.startswith(LAUNCHERS)


def with_free_port(text: str) -> str:
    if text.startswith("deepspeed "):
        return text.replace("deepspeed ", f"deepspeed --master_port {free_port()} ", 1)
    if text.startswith("accelerate launch "):
        return text.replace("accelerate launch ", f"accelerate launch --main_process_port {free_port()} ", 1)
    return text


def environment(clone: Path) -> dict[str, str]:
    # a reader's shell: none of this session's Python settings (PYTHONDONTWRITEBYTECODE would have each of the
    # ~50 processes compile the clone's modules again, where a reader's first command writes __pycache__)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "DS_ACCELERATOR", "TORCHDYNAMO_DISABLE", "PYTHONDONTWRITEBYTECODE")}
    venv_bin = str(Path(sys.executable).parent)
    env.update(PATH=venv_bin + os.pathsep + env.get("PATH", ""), VIRTUAL_ENV=str(Path(venv_bin).parent),
               PYTHONPATH=str(clone), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def test_readme_lists_its_unrun_lines_by_marker():
    cmds = readme_commands()
    assert len([c for c in cmds if c.marker is None]) >= 20
    for c in cmds:
        if c.marker is not None:
            names = [t for t in c.text.split() if PATHLIKE.match(t)]
            assert names and all((ROOT / n).exists() for n in names), c.text
    assert [note for note, _ in blocks("sh") if note] == [
        "not run: it builds the environment the README test itself runs in"]


def test_readme_spec_and_python_blocks():
    from toolkit.spec import TrainingSpec

    (spec,) = [body for _, body in blocks("yaml")]
    assert TrainingSpec.from_dict(yaml.safe_load(spec)).parallel.tp == 8
    import toolkit.hf

    for _, code in blocks("python"):
        tree = ast.parse(code)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "toolkit.hf":
                assert all(hasattr(toolkit.hf, a.name) for a in node.names)


def test_relative_links_resolve():
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name}: dangling link {target}"


def test_readme_outputs_are_git_ignored():
    """What the README's commands write (build/, runs/, data/) never shows up as a change."""
    outputs = {m[1] for c in readme_commands() if c.marker is None
               for m in re.finditer(r"(?:--out|--chart|--export-hf|--export-peft|>)\s+(\S+)", c.text)}
    assert {o.split("/")[0] for o in outputs} == {"build", "runs", "data"}
    r = subprocess.run(["git", "check-ignore", "--no-index", *sorted(outputs)], cwd=ROOT, capture_output=True, text=True)
    assert sorted(r.stdout.split()) == sorted(outputs)


def run_command(cmd: Command, clone: Path, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    r = subprocess.run(["bash", "-c", with_free_port(cmd.text)], cwd=clone, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == cmd.exit, (f"README command exited {r.returncode}, expected {cmd.exit}: {cmd.text}\n"
                                      f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    assert "Traceback" not in r.stderr, (cmd.text, r.stderr[-3000:])
    return time.perf_counter() - start, r


def kind(command: str) -> str:
    """A command's program and subcommand words, up to its first path or option."""
    words = []
    for word in command.split():
        if word.startswith("-") or "/" in word or "." in word:
            break
        words.append(word)
    return " ".join(words) or command.split()[0]


def chatter(r: subprocess.CompletedProcess) -> dict[str, int]:
    return {line: (r.stdout + r.stderr).count(line) for line in RANK_CHATTER}


@pytest.mark.multirank
def test_readme_commands_run_in_order_in_a_fresh_clone(tmp_path):
    clone = fresh_copy(tmp_path / "clone")
    env = environment(clone)
    rows, cmds = [], [c for c in readme_commands() if c.marker is None]
    for cmd in cmds:
        seconds, r = run_command(cmd, clone, env)
        rows.append((seconds, len(r.stderr.splitlines()), cmd.text[:70]))
        for check in next((c for prefix, c in EXPECT.items() if cmd.text.startswith(prefix)), []):
            assert check(r.stdout, clone), (cmd.text, r.stdout[-3000:])
        if is_launch(cmd.text):
            assert len(r.stderr.splitlines()) <= LAUNCH_STDERR_LINES, (cmd.text, r.stderr[-3000:])
            assert all(n <= RANK_CHATTER[line] for line, n in chatter(r).items()), (cmd.text, chatter(r))
    print("\n".join(f"{t:7.1f} s {n:5d} stderr lines  {c}" for t, n, c in rows))
    # a reader runs the README again in the same clone: the first command of each kind that writes a
    # folder (`toolkit plan`, `toolkit config`, `toolkit data prepare`, each `toolkit convert` direction, ...)
    again: dict[str, Command] = {}
    for c in cmds:
        if "--overwrite" in c.text and not is_launch(c.text):
            again.setdefault(kind(c.text), c)
    assert len(again) >= 8, list(again)
    for cmd in again.values():
        run_command(cmd, clone, env)
    assert all(any(c.text.startswith(p) for c in readme_commands()) for p in EXPECT), "an EXPECT entry names no command"
