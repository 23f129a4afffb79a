"""Models by name, sized for the dataset's input shape and number of classes."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from fedhier.common.errors import ConfigError
from fedhier.settings.declaration import names_of

#: the models by name, as the setting ``model`` declares them (checking a name needs no torch)
MODELS = names_of("model")


def _flat_features(input_shape: tuple[int, ...]) -> int:
    return int(math.prod(input_shape))


class LogReg(nn.Module):
    """Multinomial logistic regression: one linear layer on the flattened input."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(_flat_features(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


class MLP(nn.Module):
    """Flatten -> Linear(hidden) -> ReLU -> Linear(num_classes)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> None:
        super().__init__()
        self.hidden = nn.Linear(_flat_features(input_shape), hidden)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x.flatten(1))))


def linear_chain(model: nn.Module) -> list[tuple[str, str]] | None:
    """(weight, bias) names of a model that is Linear (-> ReLU -> Linear)*, else None.

    Such models have per-example gradients of rank one per layer (delta a^T), which the
    vectorized engine and the diagnostics exploit.
    """
    if isinstance(model, LogReg):
        return [("linear.weight", "linear.bias")]
    if isinstance(model, MLP):
        return [("hidden.weight", "hidden.bias"), ("out.weight", "out.bias")]
    return None


class CNN(nn.Module):
    """Two 3x3 conv blocks (16, 32 channels; 2x2 max-pool while the map is >= 4 px) + linear.

    Input [batch, C, H, W]; digits (1, 8, 8) gives a 2x2x32 map, Fashion-MNIST (1, 28, 28) 7x7x32.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(
                f"model 'cnn' needs image input (channels, height, width), got shape "
                f"{list(input_shape)}; use 'mlp' or 'logreg' for this dataset"
            )
        channels, height, width = input_shape
        self.conv1 = nn.Conv2d(channels, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.pool1 = min(height, width) >= 4
        if self.pool1:
            height, width = height // 2, width // 2
        self.pool2 = min(height, width) >= 4
        if self.pool2:
            height, width = height // 2, width // 2
        self.out = nn.Linear(32 * height * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        if self.pool1:
            x = nn.functional.max_pool2d(x, 2)
        x = torch.relu(self.conv2(x))
        if self.pool2:
            x = nn.functional.max_pool2d(x, 2)
        return self.out(x.flatten(1))


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998; the model of HierFAVG's MNIST runs): conv 6@5x5, 2x2
    max-pool, conv 16@5x5, 2x2 max-pool, fc 120, fc 84, fc ``num_classes``, ReLU after every
    layer but the last; 61,706 parameters for one channel and 10 classes.

    32x32 input is LeCun's own (no padding: 32 -> 28 -> 14 -> 10 -> 5); smaller images are
    padded by 2 px at conv1 (MNIST's and Fashion-MNIST's 28x28, as LeCun padded the digits:
    the same maps and 16 x 5 x 5 = 400 features to fc1). A map smaller than conv2's 5x5
    kernel (digits, 8x8: 8 -> 4) is padded by 2 px there too (4 -> 4 -> 2: 64 features); a
    pool is skipped where the map is below 2 px.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(
                f"model 'lenet5' needs image input (channels, height, width), got shape "
                f"{list(input_shape)}; use 'mlp' or 'logreg' for this dataset"
            )
        channels, height, width = input_shape
        pad1 = 0 if min(height, width) >= 32 else 2
        self.conv1 = nn.Conv2d(channels, 6, kernel_size=5, padding=pad1)
        height, width = height + 2 * pad1 - 4, width + 2 * pad1 - 4
        self.pool1 = min(height, width) >= 2
        if self.pool1:
            height, width = height // 2, width // 2
        pad2 = 0 if min(height, width) >= 5 else 2
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5, padding=pad2)
        height, width = height + 2 * pad2 - 4, width + 2 * pad2 - 4
        self.pool2 = min(height, width) >= 2
        if self.pool2:
            height, width = height // 2, width // 2
        self.fc1 = nn.Linear(16 * height * width, 120)
        self.fc2 = nn.Linear(120, 84)
        self.out = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        if self.pool1:
            x = nn.functional.max_pool2d(x, 2)
        x = torch.relu(self.conv2(x))
        if self.pool2:
            x = nn.functional.max_pool2d(x, 2)
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.out(torch.relu(self.fc2(x)))


@dataclass(frozen=True)
class ConvStage:
    """One block of a :class:`ConvChain`: Conv2d (stride 1, ``padding`` px) -> ReLU ->
    (2x2 max-pool when ``pool``)."""

    weight: str
    bias: str
    padding: int
    pool: bool


@dataclass(frozen=True)
class ConvChain:
    """A model that is conv blocks, flatten (channel, row, column order), then a
    Linear (-> ReLU -> Linear)* head: ``cnn`` and ``lenet5``. The vectorized engine batches
    such models across clients (``fedhier.engines.vectorized.conv_kernels``)."""

    stages: tuple[ConvStage, ...]
    head: tuple[tuple[str, str], ...]  # (weight, bias) of each Linear layer


def conv_chain(model: nn.Module) -> ConvChain | None:
    """The :class:`ConvChain` that ``model`` computes (``cnn``, ``lenet5``), else None
    (also for subclasses, whose forward may differ)."""
    if type(model) is CNN:
        return ConvChain((ConvStage("conv1.weight", "conv1.bias", 1, model.pool1),
                          ConvStage("conv2.weight", "conv2.bias", 1, model.pool2)),
                         (("out.weight", "out.bias"),))
    if type(model) is LeNet5:
        return ConvChain((ConvStage("conv1.weight", "conv1.bias", int(model.conv1.padding[0]),
                                    model.pool1),
                          ConvStage("conv2.weight", "conv2.bias", int(model.conv2.padding[0]),
                                    model.pool2)),
                         (("fc1.weight", "fc1.bias"), ("fc2.weight", "fc2.bias"),
                          ("out.weight", "out.bias")))
    return None


class LSTM(nn.Module):
    """Next-token model of LEAF's Shakespeare task: Embedding(vocab, 8) -> 2-layer LSTM -> Linear.

    Input: int64 token ids [batch, seq_len]; output: logits [batch, vocab] read from the last
    time step. The vocabulary is ``num_classes`` (the next token is the class). LEAF uses 256
    hidden units; the default here is 128: on a small CPU its steps and its evaluation are
    about 3x faster (see docs/data.md) and it learns about as fast per step early on. Pass
    ``hidden=256`` for LEAF's size.
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        hidden: int = 128,
        embed_dim: int = 8,
        layers: int = 2,
    ) -> None:
        super().__init__()
        if len(input_shape) != 1:
            raise ConfigError(
                f"model 'lstm' needs token sequences of shape [seq_len], got shape "
                f"{list(input_shape)}; use it with a text dataset such as 'shakespeare'"
            )
        self.embedding = nn.Embedding(num_classes, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ConfigError(
                f"model 'lstm' needs integer token ids, got {x.dtype} input; use it with a "
                "text dataset such as 'shakespeare'"
            )
        with warnings.catch_warnings():
            # Under torch.func.vmap (the vectorized engine, per-example gradients) the LSTM
            # kernel has no batching rule and runs client by client; torch warns about the
            # speed on every call. The result is exact.
            warnings.filterwarnings("ignore", message="There is a performance drop because we "
                                    "have not yet implemented the batching rule")
            hidden_states, _ = self.lstm(self.embedding(x))
        return self.out(hidden_states[:, -1])


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, seed: int | None = None
) -> nn.Module:
    """A model by name; with ``seed`` its initial weights are a function of the seed only."""
    builders = {"logreg": LogReg, "mlp": MLP, "cnn": CNN, "lstm": LSTM, "lenet5": LeNet5}
    if name not in builders:
        raise ConfigError(f"unknown model '{name}'; choose one of {', '.join(MODELS)}")
    if seed is None:
        return builders[name](tuple(input_shape), num_classes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builders[name](tuple(input_shape), num_classes)
