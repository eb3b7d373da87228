"""A user's own models for examples/plugin/recipe.yaml (model.name: my_models:MLP).

Nothing here imports hpclb: any nn.Module class, or a function returning one, can be named in a
recipe as module:attribute. The recipe's other model keys are the constructor's arguments.
"""
from torch import nn


class MLP(nn.Module):
    """Two-layer perceptron on flattened images: ``[b, 28, 28]`` float32 -> logits ``[b, 10]``."""

    def __init__(self, hidden_size: int = 64, num_classes: int = 10, in_features: int = 784):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden_size), nn.ReLU(),
                                 nn.Linear(hidden_size, num_classes))

    def forward(self, x):
        return self.net(x)


def small_cnn(channels: int = 8, num_classes: int = 10) -> nn.Module:
    """A factory: a two-convolution network on ``[b, 28, 28]`` images -> logits ``[b, 10]``."""
    return nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, channels, 3, stride=2),
                         nn.ReLU(), nn.Conv2d(channels, 2 * channels, 3, stride=2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(2 * channels * 6 * 6, num_classes))
