"""Planted wrong answers to chapter 12's exercises: each must be rejected with the hint key it names."""


def bubble_ratio(num_stages, micro_batches, stages_per_rank):  # 12.1 -> ratio
    return (num_stages - 1) / (stages_per_rank * micro_batches)


def bubble_of_1f1b(num_stages, micro_batches, stages_per_rank):  # 12.1 -> v_ignored
    return (num_stages - 1) / (micro_batches + num_stages - 1)


def bubble_share_over_v(num_stages, micro_batches, stages_per_rank):  # 12.1 -> share_divided
    return (num_stages - 1) / (micro_batches + num_stages - 1) / stages_per_rank


def state_whole_model(n_params, dp, tp, pp, stage):  # 12.2 -> no_model_split
    return 4 * n_params / (dp if stage >= 3 else 1) + 4 * n_params / (dp if stage >= 2 else 1) \
        + 8 * n_params / (dp if stage >= 1 else 1)


def state_over_world(n_params, dp, tp, pp, stage):  # 12.2 -> over_world
    k, n = n_params / (tp * pp), dp * tp * pp
    return 4 * k / (n if stage >= 3 else 1) + 4 * k / (n if stage >= 2 else 1) + 8 * k / (n if stage >= 1 else 1)


def state_stage_too_far(n_params, dp, tp, pp, stage):  # 12.2 -> stage_shifted: stage s counted as s + 1
    k, s = n_params / (tp * pp), stage + 1
    return 4 * k / (dp if s >= 3 else 1) + 4 * k / (dp if s >= 2 else 1) + 8 * k / (dp if s >= 1 else 1)


def in_flight_same_everywhere(schedule, stage, num_stages, micro_batches):  # 12.3 -> stage_ignored
    return micro_batches if schedule == "gpipe" else min(micro_batches, num_stages)


def in_flight_one_short(schedule, stage, num_stages, micro_batches):  # 12.3 -> one_short
    return micro_batches if schedule == "gpipe" else min(micro_batches, num_stages - stage) - 1


def in_flight_all(schedule, stage, num_stages, micro_batches):  # 12.3 -> gpipe_for_both
    return micro_batches


PLANTED = [
    ("12.1", "ratio", bubble_ratio),
    ("12.1", "v_ignored", bubble_of_1f1b),
    ("12.1", "share_divided", bubble_share_over_v),
    ("12.2", "no_model_split", state_whole_model),
    ("12.2", "over_world", state_over_world),
    ("12.2", "stage_shifted", state_stage_too_far),
    ("12.3", "stage_ignored", in_flight_same_everywhere),
    ("12.3", "one_short", in_flight_one_short),
    ("12.3", "gpipe_for_both", in_flight_all),
]
