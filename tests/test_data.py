"""Tests of the `data` package: sources, partitions, errors and augmentation."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fedaccel.data import (
    DATASETS,
    PARTITIONS,
    ClientData,
    DataConfig,
    DataError,
    FederatedDataset,
    load_federated,
    random_crop_flip,
)

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


# ---------------------------------------------------------------- helpers


def write_idx(path: Path, arr: np.ndarray, gz: bool = True) -> None:
    """Write ``arr`` (uint8) in the IDX format: magic 0x0000 08 ndim, >u4 dims."""
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    data = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data += arr.tobytes()
    if gz:
        with gzip.open(path.with_name(path.name + ".gz"), "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def make_idx_dir(root: Path, n_train: int = 200, n_test: int = 50, gz: bool = True) -> Path:
    rng = np.random.default_rng(123)
    root.mkdir(parents=True, exist_ok=True)
    write_idx(root / "train-images-idx3-ubyte", rng.integers(0, 256, (n_train, 28, 28)), gz)
    write_idx(root / "train-labels-idx1-ubyte", np.arange(n_train) % 10, gz)
    write_idx(root / "t10k-images-idx3-ubyte", rng.integers(0, 256, (n_test, 28, 28)), gz)
    write_idx(root / "t10k-labels-idx1-ubyte", np.arange(n_test) % 10, gz)
    return root


def _pickle(path: Path, d: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(d, f, protocol=2)


def make_cifar10(parent: Path, per_batch: int = 30, n_test: int = 20) -> Path:
    rng = np.random.default_rng(7)
    folder = parent / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for i in range(1, 6):
        _pickle(folder / f"data_batch_{i}", {
            b"batch_label": b"training batch",
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, per_batch)],
            b"filenames": [b"x.png"] * per_batch,
        })
    _pickle(folder / "test_batch", {
        b"data": rng.integers(0, 256, (n_test, 3072), dtype=np.uint8),
        b"labels": [int(v) for v in rng.integers(0, 10, n_test)],
    })
    return folder


def make_cifar100(parent: Path, n_train: int = 120, n_test: int = 30) -> Path:
    rng = np.random.default_rng(8)
    folder = parent / "cifar-100-python"
    folder.mkdir(parents=True)
    for name, n in (("train", n_train), ("test", n_test)):
        _pickle(folder / name, {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"fine_labels": [int(v) for v in rng.integers(0, 100, n)],
            b"coarse_labels": [int(v) for v in rng.integers(0, 20, n)],
        })
    return folder


def check_dataset(fd: FederatedDataset, shape: tuple[int, ...], num_classes: int) -> None:
    assert fd.input_shape == shape
    assert fd.num_classes == num_classes
    assert fd.test_x.dtype == np.float32 and fd.test_y.dtype == np.int64
    assert fd.test_x.shape == (len(fd.test_y), *shape)
    assert len(fd.test_y) > 0
    sizes = fd.partition_sizes()
    assert len(sizes) == fd.num_clients and min(sizes) >= 1
    hist = fd.label_histograms()
    assert hist.shape == (fd.num_clients, num_classes)
    assert hist.sum(axis=1).tolist() == sizes
    for i in (0, fd.num_clients - 1):
        cd = fd.client(i)
        assert isinstance(cd, ClientData)
        for x, y in ((cd.x_train, cd.y_train), (cd.x_test, cd.y_test)):
            assert x.dtype == np.float32 and y.dtype == np.int64
            assert x.shape == (len(y), *shape)
            assert np.isfinite(x).all()
            if len(y):
                assert 0 <= y.min() and y.max() < num_classes
        assert len(cd.y_train) >= 1
        assert len(cd.y_train) + len(cd.y_test) == sizes[i]


def client_arrays(fd: FederatedDataset) -> list[np.ndarray]:
    out = []
    for i in range(fd.num_clients):
        cd = fd.client(i)
        out += [cd.x_train, cd.y_train, cd.x_test, cd.y_test]
    return out + [fd.test_x, fd.test_y]


# ---------------------------------------------------------------- sources


def test_public_names():
    assert DATASETS == ("synthetic", "digits", "breast-cancer", "fashion-mnist", "mnist", "cifar10", "cifar100")
    assert PARTITIONS == ("auto", "natural", "iid", "dirichlet", "dirichlet-unbalanced", "label-sorted")
    assert issubclass(DataError, ValueError)


@pytest.mark.parametrize("iid", [False, True])
def test_synthetic_shapes(iid):
    cfg = DataConfig(num_clients=8, synthetic_iid=iid, seed=3)
    fd = load_federated(cfg)
    assert fd.name == "synthetic" and not fd.augment
    check_dataset(fd, (60,), 10)
    sizes = fd.partition_sizes()
    assert min(sizes) >= 50 and max(sizes) <= cfg.synthetic_max_samples
    # global test set = union of the local test splits
    assert len(fd.test_y) == sum(len(fd.client(i).y_test) for i in range(8))
    np.testing.assert_array_equal(
        fd.test_y, np.concatenate([fd.client(i).y_test for i in range(8)])
    )


def test_synthetic_max_samples_clips():
    fd = load_federated(DataConfig(num_clients=30, synthetic_max_samples=60))
    assert max(fd.partition_sizes()) <= 60


def test_synthetic_noniid_more_heterogeneous_than_iid():
    def skew(iid):
        h = load_federated(DataConfig(num_clients=30, synthetic_iid=iid)).label_histograms()
        return float(np.mean(h.max(axis=1) / h.sum(axis=1)))

    assert skew(False) > skew(True) + 0.1


def _synthetic_by_hand(seed, users, alpha, beta, shared):
    """FedCDR appendix G.1's generator written out draw by draw (the order is
    the one that keeps FedProx's data unchanged without a shared model):
    sizes, u_k, B_k, v_k, then (shared only) W and b, then per client
    W_k = W + N(u_k, 1), b_k = b + N(u_k, 1) and x ~ N(v_k, diag(j^-1.2))."""
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.lognormal(2.0, 2, users).astype(np.int64) + 10, 50)
    u = rng.normal(0.0, alpha, users)
    big_b = rng.normal(0.0, beta, users)
    v = [rng.normal(big_b[k], 1.0, 60) for k in range(users)]
    w0, b0 = (rng.normal(0.0, 1.0, (60, 10)), rng.normal(0.0, 1.0, 10)) if shared else (0.0, 0.0)
    ys = []
    for k in range(users):
        w = w0 + rng.normal(u[k], 1.0, (60, 10))
        b = b0 + rng.normal(u[k], 1.0, 10)
        x = v[k] + rng.standard_normal((int(sizes[k]), 60)) * np.arange(1, 61) ** -0.6
        ys.append(np.argmax(x @ w + b, axis=1))
    return ys


@pytest.mark.parametrize("shared", [False, True])
def test_synthetic_client_models_are_drawn_as_the_paper_writes(shared):
    """``shared_model``: W_k - W ~ N(u_k, 1) around one W (FedCDR appendix
    G.1); without it W_k ~ N(u_k, 1) (FedProx's code), data as before."""
    from fedaccel.data.sources import generate_synthetic

    _, ys = generate_synthetic(4, 1.0, 1.0, False, 50, np.random.default_rng(7), size_mu=2.0,
                               min_samples=10, dtype=np.dtype(np.float64), shared_model=shared)
    expected = _synthetic_by_hand(7, 4, 1.0, 1.0, shared)
    for got, want in zip(ys, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_shared_model_key_reaches_the_generated_data():
    """``synthetic.shared-model=true`` in a run config gives the clients the
    shared model's labels (run config -> DataConfig -> generator)."""
    from fedaccel.local_run import default_run_config, fuse
    from fedaccel.run_config import parse_run_config
    from fedaccel.runtime import data_config_for

    def labels(shared):
        cfg = parse_run_config(fuse(default_run_config(), {"synthetic.shared-model": shared}))
        data_cfg = data_config_for(cfg, 4)
        assert data_cfg.synthetic_shared_model is shared
        return load_federated(data_cfg).training_rows()[1]

    shared, own = labels(True), labels(False)
    assert len(shared) == len(own) and not np.array_equal(shared, own)


def test_synthetic_shared_model_is_refused_with_iid():
    with pytest.raises(DataError, match="synthetic.shared-model=true applies to the non-IID"):
        DataConfig(synthetic_iid=True, synthetic_shared_model=True)
    with pytest.raises(DataError, match="synthetic.shared-model='yes' is invalid"):
        DataConfig(synthetic_shared_model="yes")


def test_synthetic_rejects_pooled_partitions():
    with pytest.raises(DataError, match="synthetic.iid"):
        DataConfig(dataset="synthetic", partition="dirichlet")


def test_synthetic_needs_test_fraction():
    with pytest.raises(DataError, match=r"local-test-fraction.*; use a local-test-fraction in \(0, 1\)"):
        load_federated(DataConfig(num_clients=3, local_test_fraction=0.0))


def test_synthetic_clients_too_small_for_a_test_sample_are_told_the_size_that_gives_one():
    """With 0.2, a client's split is round(0.2 n): 2 samples give none, 3 give one."""
    small = dict(num_clients=4, synthetic_max_samples=2, synthetic_min_samples=1)
    with pytest.raises(DataError, match=r"none of the 4 clients \(the largest has 2 samples\) gets a test "
                                        r"sample; give the clients at least 3 samples"):
        load_federated(DataConfig(**small))
    with pytest.raises(DataError, match="give the clients at least 2 samples"):
        load_federated(DataConfig(**{**small, "synthetic_max_samples": 1}, local_test_fraction=0.5))
    fd = load_federated(DataConfig(**{**small, "synthetic_max_samples": 3, "synthetic_min_samples": 3}))
    assert fd.train_sizes() == [2, 2, 2, 2] and fd.partition_sizes() == [3, 3, 3, 3]  # one test sample each


def test_digits_shapes_and_fixed_test_set():
    fd = load_federated(DataConfig(dataset="digits", num_clients=10, seed=0))
    check_dataset(fd, (1, 8, 8), 10)
    assert len(fd.test_y) == 360 and sum(fd.partition_sizes()) == 1437
    # roughly standardised
    assert abs(float(fd.test_x.mean())) < 0.1 and 0.8 < float(fd.test_x.std()) < 1.2
    other = load_federated(DataConfig(dataset="digits", num_clients=10, seed=5))
    np.testing.assert_array_equal(fd.test_x, other.test_x)
    np.testing.assert_array_equal(fd.test_y, other.test_y)
    assert not np.array_equal(fd.client(0).y_train, other.client(0).y_train)


def test_breast_cancer_is_sklearns_data_standardized_with_the_pool_as_test_set():
    from sklearn.datasets import load_breast_cancer

    raw, labels = load_breast_cancer(return_X_y=True)
    fd = load_federated(DataConfig(dataset="breast-cancer", num_clients=3, partition="iid",
                                   local_test_fraction=0.0, precision="float64"))
    check = fd.client(0)
    assert fd.name == "breast-cancer" and fd.input_shape == (30,) and fd.num_classes == 2 and not fd.augment
    assert check.x_train.dtype == np.float64 and check.y_train.dtype == np.int64
    x, y = fd.training_rows()  # every client's rows, in pool order: sklearn's 569 samples
    assert x.shape == (569, 30) and np.bincount(y).tolist() == [212, 357]
    np.testing.assert_array_equal(x, (raw - raw.mean(0)) / raw.std(0))  # each feature, over all 569
    np.testing.assert_allclose(x.mean(0), 0.0, atol=1e-12)
    np.testing.assert_allclose(x.std(0), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(y, labels)
    # no held-out set: the server's test set is the whole data
    np.testing.assert_array_equal(fd.test_x, x)
    np.testing.assert_array_equal(fd.test_y, y)
    # float32 (the default) is the float64 standardisation, rounded
    fd32 = load_federated(DataConfig(dataset="breast-cancer", num_clients=3, partition="iid",
                                     local_test_fraction=0.0))
    assert fd32.test_x.dtype == np.float32
    np.testing.assert_array_equal(fd32.test_x, x.astype(np.float32))


@pytest.mark.parametrize("clients", [10, 6])
def test_label_sorted_is_the_split_of_the_fedpm_test1_script(monkeypatch, clients):
    """bench/fedpm_test1.py's breast_cancer_clients: rows sorted by label (ties
    by the first feature), contiguous shards of Dirichlet(2) sizes >= 20 drawn
    with seed 0; the same rows in the same order, client by client."""
    from test_configs import _bench

    shards, _, _ = _bench(monkeypatch, "fedpm_test1").breast_cancer_clients(clients)
    fd = load_federated(DataConfig(dataset="breast-cancer", num_clients=clients, partition="label-sorted",
                                   dirichlet_alpha=2.0, local_test_fraction=0.0, precision="float64", seed=0))
    assert fd.num_clients == len(shards) == clients
    for i, (xs, ys) in enumerate(shards):
        part = fd.client(i)
        np.testing.assert_array_equal(part.x_train, xs.numpy())
        np.testing.assert_array_equal(part.y_train, ys.numpy())
    if clients == 10:  # the sizes docs/fedpm.md reports
        assert fd.partition_sizes() == [67, 98, 40, 147, 34, 36, 20, 20, 40, 67]


def test_label_sorted_sorts_by_label_keeps_training_rows_in_order_and_refuses_empty_clients():
    fd = load_federated(DataConfig(dataset="digits", num_clients=8, partition="label-sorted",
                                   dirichlet_alpha=2.0, seed=3))
    labels = [fd.client(i).y_train for i in range(8)]
    assert all(np.all(np.diff(y) >= 0) for y in labels)  # each client's training rows stay sorted
    every = np.concatenate(labels)
    assert np.all(np.diff(every) >= 0)  # the clients are consecutive shards of the sorted pool
    assert sum(fd.partition_sizes()) == 1437
    assert len(fd.client(0).y_test) > 0  # the local test split is drawn as for any partition
    with pytest.raises(DataError) as info:
        load_federated(DataConfig(dataset="breast-cancer", num_clients=40, partition="label-sorted"))
    msg = str(info.value)
    assert "\n" not in msg and "partition='label-sorted'" in msg and "of the 40 clients" in msg
    fits = int(msg.split("the most clients that fit is ")[1].split()[0])
    load_federated(DataConfig(dataset="breast-cancer", num_clients=fits, partition="label-sorted"))


def test_float64_precision_keeps_the_data_in_float64():
    a = load_federated(DataConfig(dataset="digits", num_clients=4, partition="iid"))
    b = load_federated(DataConfig(dataset="digits", num_clients=4, partition="iid", precision="float64"))
    assert a.client(1).x_train.dtype == np.float32 and b.client(1).x_train.dtype == np.float64
    assert b.test_x.dtype == np.float64
    np.testing.assert_allclose(b.client(1).x_train, a.client(1).x_train, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(b.client(1).x_train, a.client(1).x_train.astype(np.float64))  # not widened
    syn = load_federated(DataConfig(num_clients=3, precision="float64")).client(0).x_train
    assert syn.dtype == np.float64
    with pytest.raises(DataError, match="precision='float16' is unknown; allowed: float32, float64"):
        DataConfig(precision="float16")


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_files(tmp_path, gz):
    make_idx_dir(tmp_path, gz=gz)
    fd = load_federated(DataConfig(dataset="mnist", num_clients=4, partition="iid",
                                   data_dir=str(tmp_path)))
    check_dataset(fd, (1, 28, 28), 10)
    assert sum(fd.partition_sizes()) == 200 and len(fd.test_y) == 50
    assert not fd.augment
    # normalised with the MNIST mean/std
    raw_min = (0 - 0.1307) / 0.3081
    assert np.isclose(fd.test_x.min(), raw_min, atol=1e-4)


def test_fashion_mnist_idx_files_in_subfolder(tmp_path):
    make_idx_dir(tmp_path / "fashion-mnist")
    fd = load_federated(DataConfig(dataset="fashion-mnist", num_clients=5,
                                   data_dir=str(tmp_path)))
    check_dataset(fd, (1, 28, 28), 10)
    assert fd.partition_sizes() == [40] * 5


def test_idx_bad_magic(tmp_path):
    make_idx_dir(tmp_path, gz=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x12\x34\x08\x01" + b"\0" * 8)
    with pytest.raises(DataError, match="magic"):
        load_federated(DataConfig(dataset="mnist", data_dir=str(tmp_path)))


@pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="dataset-fashion-mnist not installed")
def test_fashion_mnist_real_files():
    fd = load_federated(DataConfig(dataset="fashion-mnist", num_clients=10, partition="iid"))
    check_dataset(fd, (1, 28, 28), 10)
    assert sum(fd.partition_sizes()) == 60000 and len(fd.test_y) == 10000
    assert np.bincount(fd.test_y).tolist() == [1000] * 10
    assert abs(float(fd.test_x.mean())) < 0.1 and 0.8 < float(fd.test_x.std()) < 1.2


@pytest.mark.parametrize("point_at_folder", [False, True])
def test_cifar10_pickles(tmp_path, point_at_folder):
    folder = make_cifar10(tmp_path)
    d = folder if point_at_folder else tmp_path
    fd = load_federated(DataConfig(dataset="cifar10", num_clients=5, partition="iid",
                                   data_dir=str(d)))
    assert fd.augment
    check_dataset(fd, (3, 32, 32), 10)
    assert sum(fd.partition_sizes()) == 150 and len(fd.test_y) == 20


def test_cifar100_pickles(tmp_path):
    make_cifar100(tmp_path)
    fd = load_federated(DataConfig(dataset="cifar100", num_clients=4,
                                   partition="dirichlet", data_dir=str(tmp_path)))
    assert fd.augment
    check_dataset(fd, (3, 32, 32), 100)
    assert fd.partition_sizes() == [30] * 4 and len(fd.test_y) == 30


def test_cifar_normalisation_per_channel(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    # every pixel of channel c has value 255 * mean_c -> normalises to 0
    mean = np.array([0.4914, 0.4822, 0.4465])
    img = np.repeat(np.round(255 * mean).astype(np.uint8), 1024)[None, :]
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        _pickle(folder / name, {b"data": np.repeat(img, 2, axis=0), b"labels": [0, 1]})
    fd = load_federated(DataConfig(dataset="cifar10", num_clients=2, partition="iid",
                                   data_dir=str(tmp_path)))
    assert np.abs(fd.test_x).max() < 0.01


# ---------------------------------------------------------------- errors


def test_missing_fashion_mnist_file_message(tmp_path):
    make_idx_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError) as info:
        load_federated(DataConfig(dataset="fashion-mnist", data_dir=str(tmp_path)))
    msg = str(info.value)
    assert "\n" not in msg
    assert str(tmp_path / "t10k-labels-idx1-ubyte.gz") in msg
    assert str(tmp_path) in msg
    assert "data-dir" in msg
    assert "apt-get install dataset-fashion-mnist" in msg


def test_missing_mnist_message(tmp_path):
    with pytest.raises(DataError) as info:
        load_federated(DataConfig(dataset="mnist", data_dir=str(tmp_path / "nowhere")))
    msg = str(info.value)
    assert "train-images-idx3-ubyte" in msg and "nowhere" in msg and "data-dir" in msg


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_missing_cifar_message(tmp_path, dataset):
    with pytest.raises(DataError) as info:
        load_federated(DataConfig(dataset=dataset, data_dir=str(tmp_path / "empty")))
    msg = str(info.value)
    assert "\n" not in msg and "data-dir" in msg and "empty" in msg
    assert ("test_batch" if dataset == "cifar10" else "cifar-100-python") in msg


def test_too_many_clients():
    with pytest.raises(DataError) as info:
        load_federated(DataConfig(dataset="digits", num_clients=5000))
    msg = str(info.value)
    assert "num-clients=5000" in msg and "1437" in msg and "'digits'" in msg


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"dataset": "imagenet"}, "dataset="),
        ({"partition": "pathological"}, "partition="),
        ({"dataset": "digits", "dirichlet_alpha": 0.0}, "dirichlet-alpha=0.0"),
        ({"dataset": "digits", "dirichlet_alpha": -1.0}, "dirichlet-alpha=-1.0"),
        ({"num_clients": 0}, "num-clients=0"),
        ({"local_test_fraction": 1.0}, "local-test-fraction=1.0"),
        ({"local_test_fraction": -0.1}, "local-test-fraction=-0.1"),
        ({"synthetic_alpha": -1.0}, "synthetic.alpha"),
        ({"synthetic_max_samples": 0}, "synthetic.max-samples"),
        ({"dataset": "digits", "partition": "natural"}, "partition='natural'"),
    ],
)
def test_invalid_config(kwargs, key):
    with pytest.raises(DataError) as info:
        DataConfig(**kwargs)
    assert key in str(info.value) and "\n" not in str(info.value)


def test_unknown_dataset_lists_allowed():
    with pytest.raises(DataError, match="cifar100"):
        DataConfig(dataset="imagenet")


def test_client_out_of_range():
    fd = load_federated(DataConfig(num_clients=3))
    with pytest.raises(DataError):
        fd.client(3)
    with pytest.raises(DataError):
        fd.client(-1)


def test_unsatisfiable_unbalanced_dirichlet():
    # 1437 samples over 140 clients with a floor of 10 each and very skewed labels
    with pytest.raises(DataError, match="dirichlet-alpha"):
        load_federated(DataConfig(dataset="digits", num_clients=140,
                                  partition="dirichlet-unbalanced", dirichlet_alpha=0.01))


# ---------------------------------------------------------------- determinism and partitions


@pytest.mark.parametrize("dataset, partition", [
    ("synthetic", "auto"), ("digits", "iid"), ("digits", "dirichlet"),
    ("digits", "dirichlet-unbalanced"),
])
def test_determinism(dataset, partition):
    cfg = DataConfig(dataset=dataset, partition=partition, num_clients=6, seed=11)
    a = load_federated(cfg)
    load_federated.cache_clear()
    b = load_federated(DataConfig(dataset=dataset, partition=partition, num_clients=6, seed=11))
    assert a is not b
    for u, v in zip(client_arrays(a), client_arrays(b)):
        np.testing.assert_array_equal(u, v)
    c = load_federated(DataConfig(dataset=dataset, partition=partition, num_clients=6, seed=12))
    assert not np.array_equal(a.client(0).y_train, c.client(0).y_train) or \
        not np.array_equal(a.client(0).x_train, c.client(0).x_train)


def test_cached():
    cfg = DataConfig(dataset="digits", num_clients=7)
    assert load_federated(cfg) is load_federated(DataConfig(dataset="digits", num_clients=7))


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_equal_sizes(partition):
    fd = load_federated(DataConfig(dataset="digits", num_clients=13, partition=partition))
    sizes = fd.partition_sizes()
    assert sum(sizes) == 1437 and max(sizes) - min(sizes) <= 1 and min(sizes) > 0
    # every pool sample belongs to exactly one client
    assert fd.label_histograms().sum() == 1437


def test_unbalanced_sizes_differ():
    fd = load_federated(DataConfig(dataset="digits", num_clients=10,
                                   partition="dirichlet-unbalanced", dirichlet_alpha=0.3))
    sizes = fd.partition_sizes()
    assert sum(sizes) == 1437 and min(sizes) >= 10
    assert max(sizes) - min(sizes) > 20


def _max_class_share(fd: FederatedDataset) -> float:
    h = fd.label_histograms()
    return float(np.mean(h.max(axis=1) / h.sum(axis=1)))


@pytest.mark.parametrize("partition", ["dirichlet", "dirichlet-unbalanced"])
def test_dirichlet_skew(partition):
    def share(p, alpha):
        return _max_class_share(load_federated(DataConfig(
            dataset="digits", num_clients=10, partition=p, dirichlet_alpha=alpha)))

    iid = share("iid", 0.3)
    skewed = share(partition, 0.1)
    flat = share(partition, 1000.0)
    assert iid < 0.25
    assert skewed > 0.35 and skewed > 2 * iid
    assert abs(flat - iid) < 0.08


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5])
def test_local_test_split_sizes(fraction):
    fd = load_federated(DataConfig(dataset="digits", num_clients=10, partition="iid",
                                   local_test_fraction=fraction))
    for i, n in enumerate(fd.partition_sizes()):
        cd = fd.client(i)
        assert len(cd.y_test) == int(np.floor(n * fraction + 0.5))
        assert len(cd.y_train) == n - len(cd.y_test)


@pytest.mark.slow  # a subprocess or a whole run: the full suite runs it
def test_one_sample_clients_have_empty_test_split():
    fd = load_federated(DataConfig(dataset="digits", num_clients=1437, partition="iid",
                                   local_test_fraction=0.5))
    assert fd.partition_sizes() == [1] * 1437
    cd = fd.client(100)
    assert len(cd.y_train) == 1 and len(cd.y_test) == 0
    assert cd.x_test.shape == (0, 1, 8, 8)


def test_client_arrays_are_independent_copies():
    fd = load_federated(DataConfig(num_clients=2))
    cd = fd.client(0)
    cd.x_train[:] = 0
    assert np.abs(fd.client(0).x_train).sum() > 0


# ---------------------------------------------------------------- augmentation


def test_random_crop_flip_deterministic_and_shape():
    x = torch.randn(16, 3, 32, 32)
    a = random_crop_flip(x, torch.Generator().manual_seed(0))
    b = random_crop_flip(x, torch.Generator().manual_seed(0))
    c = random_crop_flip(x, torch.Generator().manual_seed(1))
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, x)


def test_random_crop_flip_is_crop_of_padded_or_its_flip():
    x = torch.arange(2 * 1 * 6 * 6, dtype=torch.float32).reshape(2, 1, 6, 6) + 1
    g = torch.Generator().manual_seed(3)
    seen_flip = seen_plain = False
    for _ in range(20):
        out = random_crop_flip(x, g)
        padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
        for s in range(2):
            crops = [padded[s, :, dy:dy + 6, dx:dx + 6] for dy in range(9) for dx in range(9)]
            plain = any(torch.equal(out[s], cr) for cr in crops)
            flipped = any(torch.equal(out[s], cr.flip(-1)) for cr in crops)
            assert plain or flipped
            seen_plain |= plain
            seen_flip |= flipped and not plain
    assert seen_plain and seen_flip


def test_random_crop_flip_rejects_non_batch():
    with pytest.raises(ValueError):
        random_crop_flip(torch.zeros(3, 32, 32), torch.Generator())


# ---------------------------------------------------------------- extras


def test_env_data_dir_override(tmp_path, monkeypatch):
    make_idx_dir(tmp_path / "mnist", n_train=30, n_test=10)
    monkeypatch.setenv("FEDACCEL_DATA_DIR", str(tmp_path))
    load_federated.cache_clear()
    fd = load_federated(DataConfig(dataset="mnist", num_clients=3, partition="iid"))
    load_federated.cache_clear()
    assert sum(fd.partition_sizes()) == 30 and len(fd.test_y) == 10


def test_degenerate_inner_dirichlet_is_a_data_error():
    with pytest.raises(DataError, match="dirichlet-alpha"):
        load_federated(DataConfig(dataset="digits", num_clients=50, partition="dirichlet",
                                  dirichlet_alpha=0.001))


def test_config_normalises_scalars_for_the_cache():
    a = DataConfig(num_clients=np.int64(5), dirichlet_alpha=1, seed=np.int32(2))
    b = DataConfig(num_clients=5, dirichlet_alpha=1.0, seed=2)
    assert a == b and hash(a) == hash(b) and type(a.num_clients) is int
    with pytest.raises(DataError, match="num-clients"):
        DataConfig(num_clients=2.5)


def test_train_samples_takes_a_seeded_subset_before_partitioning(tmp_path):
    make_idx_dir(tmp_path / "fashion-mnist")
    full = load_federated(DataConfig(dataset="fashion-mnist", num_clients=5, data_dir=str(tmp_path)))
    sub = load_federated(DataConfig(dataset="fashion-mnist", num_clients=5, data_dir=str(tmp_path),
                                    train_samples=100))
    again = load_federated(DataConfig(dataset="fashion-mnist", num_clients=5, data_dir=str(tmp_path),
                                      train_samples=100))
    assert sum(full.partition_sizes()) == 200 and sum(sub.partition_sizes()) == 100
    assert sub.partition_sizes() == [20] * 5
    np.testing.assert_array_equal(sub.client(3).y_train, again.client(3).y_train)
    np.testing.assert_array_equal(sub.test_x, full.test_x)  # the server test set is untouched
    with pytest.raises(DataError, match="train-samples=500 exceeds the 200"):
        load_federated(DataConfig(dataset="fashion-mnist", num_clients=5, data_dir=str(tmp_path),
                                  train_samples=500))
