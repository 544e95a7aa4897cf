"""Instructor solutions of chapter 07's exercises."""
import math

from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def linear_cost(linear, in_shape, bytes_per_value):
    """07.1: FLOPs and minimum bytes moved of one nn.Linear forward on an input of shape ``in_shape``."""
    rows = math.prod(in_shape[:-1])  # every leading dimension is a batch dimension
    flops = 2 * rows * linear.in_features * linear.out_features
    values = rows * linear.in_features + linear.weight.numel() + rows * linear.out_features
    if linear.bias is not None:
        values += linear.bias.numel()
    return flops, values * bytes_per_value


def attainable_tflops(peak_tflops, bandwidth_gbs, intensity):
    """07.2: the roofline: min(peak, bandwidth x intensity), in TFLOP/s."""
    return min(peak_tflops, bandwidth_gbs * intensity / 1e3)


def step_flops_per_image(model, images, labels):
    """07.3: FLOPs of one training step (forward, cross-entropy, backward) per image, counted by PyTorch."""
    with FlopCounterMode(display=False) as count:
        nn.functional.cross_entropy(model(images), labels).backward()
    return count.get_total_flops() / len(images)


SOLUTIONS = {"07.1": linear_cost, "07.2": attainable_tflops, "07.3": step_flops_per_image}
