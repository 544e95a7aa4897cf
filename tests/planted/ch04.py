"""Wrong answers to chapter 04's exercises, each with the hint key its check must choose."""
from torch import nn


def bubble_over_m(stages, micro_batches):
    return (stages - 1) / micro_batches


def bubble_percent(stages, micro_batches):
    return 100 * (stages - 1) / (micro_batches + stages - 1)


def bubble_swapped(stages, micro_batches):
    return (micro_batches - 1) / (micro_batches + stages - 1)


class NoTransfer(nn.Module):
    def __init__(self, net, devices, split_at):
        super().__init__()
        self.first, self.second = net[:split_at].to(devices[0]), net[split_at:].to(devices[1])

    def forward(self, x):
        return self.second(self.first(x))


class OffByOne(nn.Module):
    def __init__(self, net, devices, split_at):
        super().__init__()
        self.devices = devices
        self.first, self.second = net[:split_at + 1].to(devices[0]), net[split_at + 1:].to(devices[1])

    def forward(self, x):
        return self.second(self.first(x.to(self.devices[0])).to(self.devices[1]))


class OneSequential(nn.Module):
    def __init__(self, net, devices, split_at):
        super().__init__()
        self.devices, self.layers = devices, net

    def forward(self, x):
        return self.layers(x).to(self.devices[1])


def split_no_transfer(net, devices, split_at):
    return NoTransfer(net, devices, split_at)


def split_off_by_one(net, devices, split_at):
    return OffByOne(net, devices, split_at)


def split_not_split(net, devices, split_at):
    return OneSequential(net, devices, split_at)


def table_bits(rows, dim, optimizer):
    return rows * dim * 32 * {"sgd": 2, "momentum": 3, "adam": 4}[optimizer]


def table_no_gradient(rows, dim, optimizer):
    return rows * dim * 4 * {"sgd": 1, "momentum": 2, "adam": 3}[optimizer]


def table_adam_one_moment(rows, dim, optimizer):
    return rows * dim * 4 * {"sgd": 2, "momentum": 3, "adam": 3}[optimizer]


PLANTED = [
    ("04.1", "over_m", bubble_over_m),
    ("04.1", "percent", bubble_percent),
    ("04.1", "swapped", bubble_swapped),
    ("04.2", "no_transfer", split_no_transfer),
    ("04.2", "split_point", split_off_by_one),
    ("04.2", "no_stages", split_not_split),
    ("04.3", "units", table_bits),
    ("04.3", "no_gradient", table_no_gradient),
    ("04.3", "optimizer_state", table_adam_one_moment),
]
