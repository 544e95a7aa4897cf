"""Instructor solutions to chapter 02's exercises (02_wrapped_attributes). Not part of the package or the book."""


def owner(wrapper, name):
    """02.1: "wrapper" if the wrapper itself answers `name`, "model" if the lookup reaches the model, else None."""
    tables = (wrapper._parameters, wrapper._buffers, wrapper._modules)
    if name in vars(wrapper) or hasattr(type(wrapper), name) or any(name in table for table in tables):
        return "wrapper"
    if hasattr(wrapper.module, name):
        return "model"
    return None


def strip_module_prefix(state):
    """02.2: a new state dict with one leading "module." removed from each key that has it."""
    prefix = "module."
    return {(key[len(prefix):] if key.startswith(prefix) else key): value for key, value in state.items()}


def missing_and_unexpected(model, state):
    """02.3: (missing, unexpected) keys, sorted, that loading `state` into `model` would report."""
    own, theirs = set(model.state_dict()), set(state)
    return sorted(own - theirs), sorted(theirs - own)


SOLUTIONS = {"02.1": owner, "02.2": strip_module_prefix, "02.3": missing_and_unexpected}
