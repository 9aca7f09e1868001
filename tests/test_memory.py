"""A run that cannot fit in memory is refused before anything is built."""

from __future__ import annotations

import numpy as np
import pytest

from fedaccel.errors import ResourceError
from fedaccel.local_run import default_run_config, fuse, main
from fedaccel.memory import (CLIENT_BYTES, SYNTHETIC_BYTES_PER_SAMPLE, estimate_bytes,
                             expected_synthetic_samples, require_memory)
from fedaccel.run_config import parse_run_config

GIB = 2**30


def cfg(**overrides):
    return parse_run_config(fuse(default_run_config(), overrides))


def test_expected_synthetic_samples_follow_the_size_law():
    """Sizes are LogNormal(mu, 2) + min clipped to max: with max = min every
    client has exactly min samples; the default law averages about 237."""
    assert expected_synthetic_samples(cfg(**{"synthetic.min-samples": 40, "synthetic.max-samples": 40}), 10) == 400
    per_client = expected_synthetic_samples(cfg(), 1000) / 1000
    draws = np.minimum(np.random.default_rng(1).lognormal(4.0, 2, 400_000).astype(np.int64) + 50, 1000)
    assert per_client == pytest.approx(draws.mean(), rel=0.01)


def test_estimate_adds_data_and_client_contexts():
    c = cfg(**{"synthetic.min-samples": 40, "synthetic.max-samples": 40})
    need, words = estimate_bytes(c, 1000)
    assert need == 1000 * 40 * SYNTHETIC_BYTES_PER_SAMPLE + 1000 * CLIENT_BYTES
    assert "40,000 synthetic samples" in words and "1,000 client contexts" in words
    server_only, _ = estimate_bytes(c, 1000, client_contexts=False)
    assert server_only == 1000 * 40 * SYNTHETIC_BYTES_PER_SAMPLE
    images, words = estimate_bytes(cfg(dataset="digits"), 1000)
    assert images == 1000 * CLIENT_BYTES and "synthetic" not in words


def test_refused_above_the_available_memory_only(monkeypatch):
    c = cfg()
    need, _ = estimate_bytes(c, 100_000)
    require_memory(c, 100_000, available=int(need / 0.9) + 1)  # fits
    monkeypatch.setattr("fedaccel.memory.available_bytes", lambda: None)
    require_memory(c, 10**9)  # a machine that does not say is not checked
    with pytest.raises(ResourceError, match=r"100,000 clients need about .* GiB of memory .* but this "
                                            r"machine has 1\.0 GiB available: use fewer clients"):
        require_memory(c, 100_000, available=GIB)


def test_ten_million_clients_is_one_line_and_exit_3_at_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fedaccel.memory.available_bytes", lambda: 24 * GIB)
    code = main([f"results-dir='{tmp_path}'", "--num-clients", "10000000", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and len(err) == 1
    assert "10,000,000 clients need about" in err[0] and "24.0 GiB available" in err[0]
    assert "use fewer clients (fedaccel-run --num-clients" in err[0]
    assert not any(tmp_path.iterdir())
    # on cohort nodes the clients are logical-clients: the line names that key
    code = main([f"results-dir='{tmp_path}'", "--num-clients", "2", "logical-clients=10000000", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and len(err) == 1 and "use fewer clients (lower logical-clients)" in err[0]


def test_free_memory_is_read_where_the_tensors_live(monkeypatch):
    """Cohort chunks are sized to the memory of the device that trains them:
    a CUDA device's free memory plus what PyTorch's allocator holds unused,
    not the host's (a GPU with 4 GiB free on a host with 100 GiB)."""
    import torch

    from fedaccel.memory import available_bytes_on

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GIB, 16 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GIB)
    monkeypatch.setattr("fedaccel.memory.available_bytes", lambda: 100 * GIB)
    assert available_bytes_on(torch.device("cuda", 0)) == 4 * GIB
    assert available_bytes_on(torch.device("cpu")) == 100 * GIB


def test_the_cohort_chunk_asks_the_training_datas_device(monkeypatch):
    """``cohort-chunk=0`` sizes the chunk from the free memory of the device
    the clients' data (and model) live on."""
    from types import SimpleNamespace

    import torch

    import fedaccel.apps.client_app as ca
    from fedaccel.models import build_model

    asked = []
    monkeypatch.setattr(ca, "available_bytes_on", lambda device: asked.append(device) or 10**12)
    rt = SimpleNamespace(cfg=SimpleNamespace(cohort_chunk=0, batch_size=16), model=build_model("mlp", (6,), 3),
                         train=SimpleNamespace(x=torch.zeros(5, 6), pool=None, num_examples=5),
                         solver=SimpleNamespace(cohort_bytes=lambda model: 0))
    assert ca.cohort_chunk(rt) > 1000 and asked == [torch.device("cpu")]
    rt.cfg.cohort_chunk = 7
    assert ca.cohort_chunk(rt) == 7 and len(asked) == 1  # an explicit size asks nothing


def test_the_upload_room_is_a_quarter_of_the_training_devices_memory_off_the_cpu(monkeypatch):
    """The round's uploads may stay on a GPU in a quarter of its available
    memory (beside the quarter a chunk trains in); on the CPU there is no
    room to reserve (the uploads are host memory anyway) and nothing is asked."""
    from types import SimpleNamespace

    import torch

    import fedaccel.apps.client_app as ca

    asked = []
    monkeypatch.setattr(ca, "available_bytes_on", lambda device: asked.append(device) or 8 * GIB)
    assert ca.upload_room(SimpleNamespace(train=SimpleNamespace(x=torch.zeros(5, 6)))) is None and not asked
    on_meta = SimpleNamespace(train=SimpleNamespace(x=torch.zeros(5, 6, device="meta")))  # a device that is not the CPU
    assert ca.upload_room(on_meta) == 2 * GIB and asked == [torch.device("meta")]
    monkeypatch.setattr(ca, "available_bytes_on", lambda device: None)
    assert ca.upload_room(on_meta) is None
