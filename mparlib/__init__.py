"""mparlib: the shared code of the course "Training on many devices with PyTorch".

A notebook defines what it teaches; this package holds what several chapters reuse, one idea per module (the
README's "Layout" lists them). The training loop is `mparlib.train.train` (`from mparlib import train` gives the
module). Importing mparlib changes no global setting: the course's figure style is `mparlib.plot.use_course_style()`.
"""
from .checkpoint import load_checkpoint, save_checkpoint, state_dict_of, unwrap
from .devices import (check_device, check_devices, num_gpus, profile, profile_line, report, require_gpus,
                      try_all_gpus, try_gpu)
from .errors import CheckpointMismatchError, MparlibError
from .lang import language, tr
from .models import Residual, init_weights, resnet18
from .parallel import data_parallel, gather, parallel_apply, replicate, scatter, scatter_kwargs
from .timing import Timer
from .wrapper import AttrDataParallel

__version__ = "0.1.0"
