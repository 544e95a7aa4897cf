"""Planted wrong answers to chapter 11's exercises: each must be rejected with the hint key it names."""
import torch

from mparlib.ring_attention import merge


def merge_averaged(out_a, lse_a, out_b, lse_b):  # 11.1 -> plain_average
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_old_lse(out_a, lse_a, out_b, lse_b):  # 11.1 -> lse_not_updated: right output, lse of one part
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1), lse_a


def merge_of_the_chapter(out_a, lse_a, out_b, lse_b):  # 11.1 -> chapter_function
    return merge(out_a, lse_a, out_b, lse_b)


def merge_unbroadcast(out_a, lse_a, out_b, lse_b):  # 11.1 -> no_broadcast: weights of shape (B, H, T)
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse) + out_b * torch.exp(lse_b - lse), lse


def positions_contiguous(length, world, rank):  # 11.2 -> contiguous
    return list(range(rank * length // world, (rank + 1) * length // world))


def positions_late_chunk_off(length, world, rank):  # 11.2 -> off_by_one: late chunk 2N - 2 - r, wrapping
    c = length // (2 * world)
    late = (2 * world - 2 - rank) % (2 * world)
    late = late if late != rank else 2 * world - 1
    return list(range(rank * c, (rank + 1) * c)) + list(range(late * c, (late + 1) * c))


def splits_per_expert(expert_of_row, num_experts, world):  # 11.3 -> per_expert
    return torch.bincount(expert_of_row, minlength=num_experts).tolist()


def splits_round_robin(expert_of_row, num_experts, world):  # 11.3 -> round_robin
    return torch.bincount(expert_of_row % world, minlength=world).tolist()


PLANTED = [
    ("11.1", "plain_average", merge_averaged),
    ("11.1", "lse_not_updated", merge_old_lse),
    ("11.1", "chapter_function", merge_of_the_chapter),
    ("11.1", "no_broadcast", merge_unbroadcast),
    ("11.2", "contiguous", positions_contiguous),
    ("11.2", "off_by_one", positions_late_chunk_off),
    ("11.3", "per_expert", splits_per_expert),
    ("11.3", "round_robin", splits_round_robin),
]
