"""Instructor solutions to chapter 04's exercises (04_hybrid_cpu_gpu). Not part of the package or the book."""
from torch import nn


def bubble_fraction(stages, micro_batches):
    """04.1: the share of a GPipe forward's ticks in which a stage idles."""
    return (stages - 1) / (micro_batches + stages - 1)


class TwoStages(nn.Module):
    """The layers before `split_at` on devices[0], the rest on devices[1]."""

    def __init__(self, net, devices, split_at):
        super().__init__()
        self.devices = list(devices)
        self.first = net[:split_at].to(self.devices[0])
        self.second = net[split_at:].to(self.devices[1])

    def forward(self, x):
        return self.second(self.first(x.to(self.devices[0])).to(self.devices[1]))


def split_in_two(net, devices, split_at):
    """04.2: `net` (an nn.Sequential) split into two stages on two devices."""
    return TwoStages(net, devices, split_at)


def table_bytes(rows, dim, optimizer):
    """04.3: bytes of a float32 table with its dense gradient and the optimiser's state."""
    copies = {"sgd": 2, "momentum": 3, "adam": 4}[optimizer]
    return rows * dim * 4 * copies


SOLUTIONS = {"04.1": bubble_fraction, "04.2": split_in_two, "04.3": table_bytes}
