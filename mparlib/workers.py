"""Worker modules a notebook writes for itself: the ``%%worker`` cell magic.

A rank that ``launch`` starts imports its worker by module name, and a notebook's own functions live in ``__main__``, which
no other process can import. The ``%%worker NAME`` cell magic (``%load_ext mparlib.launch`` first) turns a code
cell into the module ``NAME`` in a temporary folder of this kernel, imports it, and puts the folder on the module
search path that each launch hands its ranks. Nothing is written into the course's folders. Explained in 06_ddp.
"""
import atexit
import importlib
import importlib.util
import keyword
import shutil
import sys
import tempfile
import unicodedata
from pathlib import Path

from .errors import ConfigError
from .lang import tr

_FOLDER = []  # this kernel's worker folder, made on first use and removed when the kernel exits


def worker_folder():
    """The temporary folder holding this kernel's worker modules (on ``sys.path``). Explained in 06_ddp."""
    if not _FOLDER:
        folder = tempfile.mkdtemp(prefix="mparlib-workers-")
        atexit.register(shutil.rmtree, folder, True)
        sys.path.insert(0, folder)  # each launch hands its ranks the launcher's sys.path
        _FOLDER.append(Path(folder))
    return _FOLDER[0]


def write_worker(name, source):
    """Write ``source`` as the importable module ``name`` and (re)import it; return the module. Explained in 06_ddp."""
    if not (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)):
        raise ConfigError(tr(f"%%worker {name!r}: give the module a Python name, e.g. %%worker my_workers.",
                             f"%%worker {name!r}: モジュールには %%worker my_workers のように Python の名前を付けて"
                             "ください。"))
    ascii_name = unicodedata.normalize("NFKC", name)
    if ascii_name != name:  # Python reads `import ｍｙ＿ｗｏｒｋｅｒｓ` as `import my_workers`: another module
        raise ConfigError(tr(f"%%worker {name}: the name has full-width (zenkaku) characters, which Python reads as "
                             f"{ascii_name!r} in an import, so the next cell would import another module. Type the "
                             f"name in ASCII (hankaku): %%worker {ascii_name}",
                             f"%%worker {name}: 名前に全角の文字があります。Python は import でこれを {ascii_name!r} と"
                             "読むので、次のセルでは別のモジュールをインポートしてしまいます。名前は半角（ASCII）で入力"
                             f"してください: %%worker {ascii_name}"))
    folder = worker_folder()
    path = folder / f"{name}.py"
    if not path.exists() and (name in sys.modules or importlib.util.find_spec(name) is not None):
        raise ConfigError(tr(f"%%worker {name}: a module named {name!r} is already imported or installed; a worker "
                             "of that name would hide it from every process. Choose another name, e.g. my_workers.",
                             f"%%worker {name}: {name!r} という名前のモジュールはすでにインポートされているか、"
                             "インストールされています。同じ名前のワーカーはすべてのプロセスからそれを隠してしまうので、"
                             "my_workers のような別の名前を付けてください。"))
    path.write_text(source if source.endswith("\n") else source + "\n", encoding="utf-8")
    importlib.invalidate_caches()
    sys.modules.pop(name, None)  # an edited cell replaces the module: import it afresh
    return importlib.import_module(name)


def register_magic(ipython):
    """Register the ``%%worker NAME`` cell magic in ``ipython`` (``%load_ext mparlib.launch``). Explained in 06_ddp."""

    def worker(line, cell):
        names = line.split()
        if len(names) != 1:
            raise ConfigError(tr("Use the magic as `%%worker NAME` on the first line of the cell, e.g. "
                                 "%%worker my_workers.",
                                 "マジックはセルの 1行目に `%%worker NAME`（例: %%worker my_workers）と書きます。"))
        write_worker(names[0], cell)

    ipython.register_magic_function(worker, magic_kind="cell", magic_name="worker")

