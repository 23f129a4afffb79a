"""quickstarthier: a Flower / PyTorch app on real handwritten digits (offline).

The data are scikit-learn's 1797 8x8 digits (shipped in the wheel, no download), split
80/20 into a federated training pool and a central test set; the pool is partitioned with
flwr-datasets' DirichletPartitioner, and each partition is split 80/20 into the client's
training and validation rows, as in Flower's quickstart-pytorch.
"""

import numpy as np
import torch
import torch.nn as nn
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader


class Net(nn.Module):
    """A small CNN for 1x8x8 images: two 3x3 conv blocks with 2x2 max-pooling, one linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.out = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.out(x.flatten(1))


partitioner = None  # Cache the partitioner (one per process)


def _digits():
    """(train pool, central test set) as Hugging Face datasets, images [1, 8, 8] in [0, 1]."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, stratify=digits.target, random_state=0)
    pool = Dataset.from_dict({"image": x_train, "label": y_train.astype(np.int64)})
    test = Dataset.from_dict({"image": x_test, "label": y_test.astype(np.int64)})
    return pool, test


def load_data(partition_id: int, num_partitions: int, batch_size: int = 32):
    """Load one client's partition of the digits: (trainloader, valloader)."""
    global partitioner
    if partitioner is None:
        partitioner = DirichletPartitioner(num_partitions=num_partitions, partition_by="label",
                                           alpha=1.0, min_partition_size=40, seed=42)
        partitioner.dataset = _digits()[0]
    partition = partitioner.load_partition(partition_id)
    # Divide data on each node: 80% train, 20% validation
    partition_train_test = partition.train_test_split(test_size=0.2, seed=42)
    partition_train_test = partition_train_test.with_format("torch")
    trainloader = DataLoader(partition_train_test["train"], batch_size=batch_size, shuffle=True)
    valloader = DataLoader(partition_train_test["test"], batch_size=batch_size)
    return trainloader, valloader


def load_centralized_dataset():
    """The central test set (360 digits) as a DataLoader."""
    return DataLoader(_digits()[1].with_format("torch"), batch_size=128)


def train(net, trainloader, epochs, lr, device="cpu"):
    """Train the model on the training set; returns the mean mini-batch loss."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["image"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device="cpu"):
    """Validate the model: (mean cross-entropy per example, accuracy)."""
    net.to(device)
    net.eval()
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["image"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (outputs.argmax(1) == labels).sum().item()
    return loss / len(testloader.dataset), correct / len(testloader.dataset)
