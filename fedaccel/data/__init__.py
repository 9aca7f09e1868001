"""Federated datasets for fedaccel.

Sources: FedProx's Synthetic-(alpha, beta) generator (Li et al., MLSys 2020;
the setting of FedCDR appendix G.1), scikit-learn digits and breast cancer,
MNIST and Fashion-MNIST (IDX files), CIFAR-10/100 (python pickles), in
float32 or float64 (``precision``). Pools are split among clients with
flwr-datasets partitioners (IID, Dirichlet with equal or unbalanced sizes,
label-sorted shards); each client's share is split again into train and a
local test split.

    >>> from data import DataConfig, load_federated
    >>> fd = load_federated(DataConfig(dataset="digits", num_clients=10))
    >>> cd = fd.client(0)
"""

from .augment import random_crop_flip
from .config import DATASETS, PARTITIONS, DataConfig, DataError
from .federated import ClientData, FederatedDataset, load_federated

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "ClientData",
    "DataConfig",
    "DataError",
    "FederatedDataset",
    "load_federated",
    "random_crop_flip",
]
