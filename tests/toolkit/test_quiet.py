"""toolkit.quiet silences the libraries' notices about their own calls by exact text, and only
them: the real warnings of torch and megatron-core are raised here and filtered, any other
warning still shows, and TOOLKIT_VERBOSE=1 keeps everything. (The launches' whole output is
held by tests/test_readme.py's budget of stderr lines.)"""
import contextlib
import io
import logging
import warnings
from contextlib import redirect_stdout

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from toolkit import quiet


def raised(fn) -> list[str]:
    """The warnings ``fn`` raises (an exception after them is expected: no process group here)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet.quiet_run(cpu=True, transformer_engine=False)
        with contextlib.suppress(ValueError, RuntimeError):  # no process group: only the warning matters
            fn()
    return [f"{w.category.__name__}: {w.message}" for w in seen]


def deprecated_collectives():
    """torch 2.13 deprecates these with a FutureWarning on each call (DeepSpeed's ZeRO and
    megatron's sequence parallelism make them); the call then fails without a process group."""
    t = torch.zeros(2)
    for fn in (torch.distributed.reduce_scatter_tensor, torch.distributed.all_gather_into_tensor):
        with contextlib.suppress(ValueError, RuntimeError):  # no process group: only the warning matters
            fn(t, t)
    warnings.warn("`torch.distributed.something_else` is deprecated", FutureWarning)  # not a call a library makes


def core_attn_recompute():
    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, recompute_granularity="selective",
                      recompute_modules=["core_attn"])


@pytest.fixture
def restore():
    """quiet_run sets process-wide state besides the warning filters: undo it for the next tests."""
    from transformers.utils import logging as hf_logging

    accelerate_filters = list(logging.getLogger("accelerate.accelerator").filters)
    yield
    logging.getLogger("accelerate.accelerator").filters[:] = accelerate_filters
    hf_logging.enable_progress_bar()


def test_exactly_the_libraries_notices_are_dropped(monkeypatch):
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    assert raised(deprecated_collectives) == ["FutureWarning: `torch.distributed.something_else` is deprecated"]
    assert raised(core_attn_recompute) == []
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    shown = raised(deprecated_collectives)
    assert len(shown) == 3 and "reduce_scatter_tensor` is deprecated" in shown[0]
    assert any("core_attn" in w for w in raised(core_attn_recompute))


def test_core_attn_advice_stays_for_transformer_engine(monkeypatch):
    """The advice concerns TE's fused attention: a spec that builds TE's layers keeps it."""
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet.quiet_run(cpu=False, transformer_engine=True)
        core_attn_recompute()
    assert any("core_attn" in str(w.message) for w in seen)


def test_hf_trainer_notice_and_lines(monkeypatch, restore, caplog):
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    quiet.quiet_hf_trainer()
    quiet.quiet_hf_trainer()  # each Trainer run asks again: one filter
    log = logging.getLogger("accelerate.accelerator")
    assert sum(isinstance(f, quiet._Drop) for f in log.filters) == 1
    with caplog.at_level(logging.WARNING, logger="accelerate.accelerator"):
        # accelerate/accelerator.py's text when the Trainer's 1 meets DeepSpeed's accumulation
        log.warning("Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, DeepSpeed config has 4. "
                    "Using DeepSpeed's value.")
        log.warning("Gradient accumulation steps mismatch: GradientAccumulationPlugin has 2, DeepSpeed config has 4. "
                    "Using DeepSpeed's value.")  # not the Trainer's own 1: a real mismatch, kept
    assert len(caplog.records) == 1 and "GradientAccumulationPlugin has 2," in caplog.records[0].getMessage()
    buf = io.StringIO()
    with redirect_stdout(buf), quiet.without_lines(quiet.DEEPSPEED_SHM_BUILT):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")  # deepspeed/comm/torch.py
        print("step 1 | loss 2.0")
    assert buf.getvalue() == "step 1 | loss 2.0\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch logs the notice only where no CUDA runtime is found")
def test_cuda_build_without_a_gpu_notice_is_dropped_on_a_cpu_run(monkeypatch, tmp_path, caplog):
    """torch's own _find_cuda_home, as its CUDA build runs it when DeepSpeed imports cpp_extension:
    with a CUDA_HOME and no CUDA runtime it logs the notice, which a CPU run drops and --verbose keeps."""
    from torch.utils import cpp_extension

    log = logging.getLogger("torch.utils.cpp_extension")
    monkeypatch.setattr(log, "filters", [])
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    with caplog.at_level(logging.WARNING):
        quiet.quiet_run(cpu=True, transformer_engine=False)
        assert cpp_extension._find_cuda_home() == str(tmp_path)
    assert [r.getMessage() for r in caplog.records] == [f"No CUDA runtime is found, using CUDA_HOME='{tmp_path}'"]
    caplog.clear()
    monkeypatch.delenv(quiet.VERBOSE_ENV)
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        quiet.quiet_run(cpu=True, transformer_engine=False)
        quiet.quiet_run(cpu=True, transformer_engine=False)
        cpp_extension._find_cuda_home()
        log.warning("another notice")
    assert [r.getMessage() for r in caplog.records] == ["another notice"]
    assert len(log.filters) == 1
