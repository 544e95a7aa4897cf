"""Planted wrong answers to chapter 07's exercises: each must be rejected with the hint key it names."""
import math

from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def linear_cost_once(linear, in_shape, bytes_per_value):  # 07.1 -> missing_factor_two
    rows = math.prod(in_shape[:-1])
    values = rows * linear.in_features + linear.weight.numel() + rows * linear.out_features
    values += linear.bias.numel() if linear.bias is not None else 0
    return rows * linear.in_features * linear.out_features, values * bytes_per_value


def linear_cost_first_dim(linear, in_shape, bytes_per_value):  # 07.1 -> leading_dims
    rows = in_shape[0]
    values = rows * linear.in_features + linear.weight.numel() + rows * linear.out_features
    values += linear.bias.numel() if linear.bias is not None else 0
    return 2 * rows * linear.in_features * linear.out_features, values * bytes_per_value


def linear_cost_no_bias(linear, in_shape, bytes_per_value):  # 07.1 -> bytes_parts
    rows = math.prod(in_shape[:-1])
    values = rows * linear.in_features + linear.weight.numel() + rows * linear.out_features
    return 2 * rows * linear.in_features * linear.out_features, values * bytes_per_value


def roofline_max(peak_tflops, bandwidth_gbs, intensity):  # 07.2 -> max_not_min
    return max(peak_tflops, bandwidth_gbs * intensity / 1e3)


def roofline_gflops(peak_tflops, bandwidth_gbs, intensity):  # 07.2 -> units
    return min(peak_tflops, bandwidth_gbs * intensity)


def forward_flops_per_image(model, images, labels):  # 07.3 -> forward_only
    with FlopCounterMode(display=False) as count:
        model(images)
    return count.get_total_flops() / len(images)


def step_flops_of_batch(model, images, labels):  # 07.3 -> per_image
    with FlopCounterMode(display=False) as count:
        nn.functional.cross_entropy(model(images), labels).backward()
    return count.get_total_flops()


PLANTED = [
    ("07.1", "missing_factor_two", linear_cost_once),
    ("07.1", "leading_dims", linear_cost_first_dim),
    ("07.1", "bytes_parts", linear_cost_no_bias),
    ("07.2", "max_not_min", roofline_max),
    ("07.2", "units", roofline_gflops),
    ("07.3", "forward_only", forward_flops_per_image),
    ("07.3", "per_image", step_flops_of_batch),
]
