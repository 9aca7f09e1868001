"""Device selection: TF32 off on a CUDA device unless the run asks for it."""

from __future__ import annotations

import pytest
import torch

from fedaccel.config import ConfigError
from fedaccel.local_run import default_run_config, fuse
from fedaccel.run_config import parse_run_config
from fedaccel.torch_utils import environment, select_device


@pytest.fixture
def tf32_flags():
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("tf32", [False, True])
def test_a_cuda_device_gets_the_runs_tf32_and_a_cpu_keeps_torchs(monkeypatch, tf32_flags, tf32):
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = (not tf32), (not tf32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device("auto", tf32) == torch.device("cpu")
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (not tf32, not tf32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU (faked: only flags are set)
    for name in ("auto", "cuda"):
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = (not tf32), (not tf32)
        assert select_device(name, tf32).type == "cuda"
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (tf32, tf32)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    assert environment(torch.device("cuda"))["tf32"] == ("convolutions and matrix products" if tf32 else "off")


def test_the_run_config_reads_tf32_false_by_default_and_refuses_a_non_boolean():
    assert parse_run_config(fuse(default_run_config(), {})).tf32 is False
    assert parse_run_config(fuse(default_run_config(), {"tf32": True})).tf32 is True
    with pytest.raises(ConfigError, match="tf32"):
        parse_run_config(fuse(default_run_config(), {"tf32": "yes"}))
