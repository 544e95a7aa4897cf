"""``nn.DataParallel`` that also answers for the model it wraps: ``wrapper.name`` reaches ``wrapper.module.name``.

Explained in 02_wrapped_attributes.
"""
from torch import nn

from .lang import tr


class AttrDataParallel(nn.DataParallel):
    """``nn.DataParallel`` whose wrapped module's attributes and methods are reachable on the wrapper. Explained in 02_wrapped_attributes.

    Lookup order for ``wrapper.name``:

    1. what Python finds by itself: the class's methods and properties (``forward``, ``train``, ``parameters`` ...)
       and the wrapper's own instance attributes (``device_ids``, ``training`` ...);
    2. the wrapper's own parameters, buffers and submodules, above all ``module``;
    3. the wrapped module's attribute of that name (methods, properties, submodules, plain attributes).

    So DataParallel's own names always win. Python calls ``__getattr__`` only when step 1 fails, which is why
    forwarding there cannot hide them. DataParallel has methods named ``replicate``, ``scatter``,
    ``parallel_apply`` and ``gather``: a wrapped module's methods of those names are reached through ``.module``.
    Assignments (``wrapper.name = value``) stay on the wrapper; to change the model, assign to
    ``wrapper.module.name``.

    The one-line ``def __getattr__(self, name): return getattr(self.module, name)`` recurses forever, because
    ``self.module`` is itself found only through ``__getattr__`` (chapter 02); ``super().__getattr__`` comes first.

    On a machine without a GPU, ``nn.DataParallel.__init__`` stops early and never sets ``dim``, ``output_device``
    and ``src_device_obj``; step 1 would then miss them and ``wrapper.dim`` would return the wrapped module's
    ``dim``. This class sets them there too (``output_device`` and ``src_device_obj`` are ``None``: without a GPU
    the module simply runs where it is), so the order above holds on every machine.
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0):
        super().__init__(module, device_ids, output_device, dim)
        for name, value in (("dim", dim), ("output_device", None), ("src_device_obj", None)):
            if name not in self.__dict__:
                setattr(self, name, value)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)  # step 2: parameters, buffers, submodules (incl. "module")
        except AttributeError:
            pass
        wrapped = self.__dict__.get("_modules", {}).get("module")
        if wrapped is None:
            raise AttributeError(tr(f"'{type(self).__name__}' object has no attribute '{name}'",
                                    f"'{type(self).__name__}' オブジェクトには属性 '{name}' がありません"))
        try:
            return getattr(wrapped, name)
        except AttributeError:
            if hasattr(type(wrapped), name):
                raise  # a property of the wrapped module failed inside: show its own error
            raise AttributeError(tr(f"neither '{type(self).__name__}' nor the module it wraps "
                                    f"('{type(wrapped).__name__}') has an attribute '{name}'",
                                    f"'{type(self).__name__}' にも、ラップしているモジュール"
                                    f"（'{type(wrapped).__name__}'）にも属性 '{name}' がありません")) from None
