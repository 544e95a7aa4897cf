"""Wrong answers to chapter 02's exercises, each with the hint key its check must choose."""


def owner_model_first(wrapper, name):
    if hasattr(wrapper.module, name):
        return "model"
    return "wrapper" if hasattr(wrapper, name) else None


def owner_dict_only(wrapper, name):
    if name in vars(wrapper) or hasattr(type(wrapper), name):
        return "wrapper"
    return "model" if hasattr(wrapper.module, name) else None


def owner_never_none(wrapper, name):
    tables = (wrapper._parameters, wrapper._buffers, wrapper._modules)
    if name in vars(wrapper) or hasattr(type(wrapper), name) or any(name in table for table in tables):
        return "wrapper"
    return "model"


def strip_replace(state):
    return {key.replace("module.", ""): value for key, value in state.items()}


def strip_lstrip(state):
    return {key.lstrip("module."): value for key, value in state.items()}


def strip_in_place(state):
    for key in list(state):
        if key.startswith("module."):
            state[key[len("module."):]] = state.pop(key)
    return state


def report_parameters_only(model, state):
    own, theirs = set(dict(model.named_parameters())), set(state)
    return sorted(own - theirs), sorted(theirs - own)


def report_swapped(model, state):
    own, theirs = set(model.state_dict()), set(state)
    return sorted(theirs - own), sorted(own - theirs)


def report_by_loading(model, state):
    result = model.load_state_dict(state, strict=False)
    return sorted(result.missing_keys), sorted(result.unexpected_keys)


PLANTED = [
    ("02.1", "model_first", owner_model_first),
    ("02.1", "tables_missed", owner_dict_only),
    ("02.1", "none_for_missing", owner_never_none),
    ("02.2", "everywhere", strip_replace),
    ("02.2", "lstrip", strip_lstrip),
    ("02.2", "mutated", strip_in_place),
    ("02.3", "parameters_only", report_parameters_only),
    ("02.3", "swapped", report_swapped),
    ("02.3", "loaded", report_by_loading),
]
